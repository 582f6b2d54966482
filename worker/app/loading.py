"""The worker's models loaded, each the same way whatever section configured it:
as it would run alone (its engine, its batch size derived from it where that is
left to derive), measured as it loads, the budget for them together checked
before the worker joins the group."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from worker.app.memory import check_budget, measured
from worker.app.plan import RunPlan, sized_for
from worker.compute.engines import Engine, GpuEngine, load_engine
from worker.config import Settings
from worker.config.models import ServedModel, served, settings_named

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A served model with its engine: its settings as it runs (its batch size
    derived from the loaded model where left to derive), and its topics."""

    name: str
    key: str  # where it is configured: "model" or "models.NAME"
    topics: tuple[str, ...]
    settings: Settings
    engine: Engine | GpuEngine


async def load_models(
    s: Settings, engine: Engine | GpuEngine | None = None
) -> list[LoadedModel]:
    """Every model of ``s`` loaded (``engine``: the one model's, loaded by the
    caller, not measured); a model that does not load stops start-up naming its
    section; the models' memory over ``limits.max_models_memory_mb``: exit 2."""
    models = served(s)
    assert engine is None or len(models) == 1, "an engine handed in serves one model"
    loaded: list[LoadedModel] = []
    sizes: dict[str, tuple[str, int]] = {}
    try:
        for m in models:
            one, size = (engine, 0) if engine is not None else await _load(s, m)
            sized = sized_for(m.settings, one.info)
            if sized is not m.settings:
                log.info("batch_size_derived", max_batch_size=sized.batching.max_batch_size,
                         model=m.name)  # fmt: skip
            loaded.append(LoadedModel(m.name, m.key, m.topics, sized, one))
            sizes[m.name] = (one.info.version, size)
        check_budget(sizes, s.limits.max_models_memory_mb)  # before joining the group
    except BaseException:
        close_models(loaded if engine is None else [])
        raise
    return loaded


async def _load(s: Settings, m: ServedModel) -> tuple[Engine | GpuEngine, int]:
    plan = RunPlan.of(m.settings)
    with settings_named(m.key):
        return await measured(functools.partial(
            load_engine, m.settings.model, device=s.gpu.device,
            max_batch_size=m.settings.batching.max_batch_size, cuda_graphs=s.gpu.cuda_graphs,
            buckets=plan.batch_buckets,
        ))  # fmt: skip


def close_models(models: Sequence[LoadedModel]) -> None:
    for m in models:
        m.engine.close()
