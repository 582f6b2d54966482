"""The worker's models loaded, each the same way whatever section configured it:
as it would run alone (its engine, its batch size derived from it where that is
left to derive), measured as it loads, the budget for them together checked
before the worker joins the group.

With ``repository.on_demand`` the repository's models are loaded after the
configured ones, one at a time: each bound and probed while loaded (``bind``),
measured, and kept while the budget holds it beside the others; where it does
not, the models kept before it are closed, oldest first (never a pinned one),
and a model that does not fit beside the configured and pinned models alone
stops start-up (exit 2). A model closed here keeps an ``Unloaded`` engine (its
description) and its binding: ``worker.app.demand`` loads it when needed."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import structlog

from worker.app.memory import MIB, check_budget, measured, start_runtime
from worker.app.plan import RunPlan, sized_for
from worker.compute.cpu import Unloaded
from worker.compute.engines import Engine, GpuEngine, load_engine
from worker.config import Settings
from worker.config.checks import check
from worker.config.model import is_gpu_backend
from worker.config.models import ServedModel, served, settings_named
from worker.config.repository import RepositoryModel
from worker.model.files import resolve_model_path
from worker.model.inputs import Binding
from worker.obs import metrics

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A served model with its engine: its settings as it runs (its batch size
    derived from the loaded model where left to derive), and its topics."""

    name: str
    key: str  # where it is configured: "model" or "models.NAME"
    topics: tuple[str, ...]
    settings: Settings
    engine: Engine | GpuEngine  # ``Unloaded`` where loaded by demand and closed at start
    size: int = 0  # the resident bytes its load added
    binding: Binding | None = None  # bound at load (by demand), else by the stages
    on_demand: bool = False  # loaded and evicted by demand (``worker.app.demand``)


Bind = Callable[[str, Settings, Engine | GpuEngine], Awaitable[Binding]]
"""A model's binding, probed (``worker.app.inference.bound``): ``key``, settings, engine."""


def on_demand(s: Settings, m: ServedModel) -> bool:
    return s.repository.on_demand and isinstance(m.config, RepositoryModel)


def by_demand_on_host(s: Settings, m: ServedModel) -> bool:
    """Loaded by demand and measured in host memory as it loads (here, one at a
    time). A GPU model loaded by demand loads as the others here: its stage
    measures the device memory it takes, and the budget for it is settled
    once every stage started (``worker.app.demand``)."""
    return on_demand(s, m) and not is_gpu_backend(m.config.backend)


async def load_models(
    s: Settings, engine: Engine | GpuEngine | None = None, bind: Bind | None = None
) -> list[LoadedModel]:
    """Every model of ``s`` loaded (``engine``: the one model's, loaded by the
    caller, not measured); a model that does not load stops start-up naming its
    section; the models' memory over ``limits.max_models_memory_mb``: exit 2.
    ``bind``: how models loaded by demand are bound while loaded (required then)."""
    models = served(s)
    assert engine is None or len(models) == 1, "an engine handed in serves one model"
    loaded: list[LoadedModel] = []
    sizes: dict[str, tuple[str, int]] = {}
    try:
        for m in models:
            if by_demand_on_host(s, m):
                continue
            one, size = (engine, 0) if engine is not None else await load_one(m)
            loaded.append(LoadedModel(m.name, m.key, m.topics, sized(m, one), one, size,
                                      on_demand=on_demand(s, m)))  # fmt: skip
            sizes[m.name] = (one.info.version, size)
        check_budget(sizes, s.limits.max_models_memory_mb)  # before joining the group
        demand = [m for m in models if by_demand_on_host(s, m)]
        if demand:
            assert bind is not None, "models loaded by demand are bound as they load"
            pinned = set(s.repository.pinned)
            demand.sort(key=lambda m: m.name not in pinned)  # pinned first: kept for good
            fixed = sum(size for _, size in sizes.values())
            await asyncio.to_thread(start_runtime)
            loaded += await _load_by_demand(s, demand, fixed, bind)
    except BaseException:
        close_models(loaded if engine is None else [])
        raise
    order = {m.name: i for i, m in enumerate(models)}
    return sorted(loaded, key=lambda m: order[m.name])


def sized(m: ServedModel, engine: Engine | GpuEngine) -> Settings:
    """``m``'s settings as it runs: its batch size derived from ``engine`` where left to derive."""
    sized = sized_for(m.settings, engine.info)
    if sized is not m.settings:
        log.info("batch_size_derived", max_batch_size=sized.batching.max_batch_size,
                 model=m.name)  # fmt: skip
    return sized


async def _load_by_demand(
    s: Settings, models: Sequence[ServedModel], fixed: int, bind: Bind
) -> list[LoadedModel]:
    """The repository's models, pinned first, each loaded, bound and measured,
    kept while the budget holds it (the module's docstring)."""
    budget = s.limits.max_models_memory_mb * MIB
    pinned = set(s.repository.pinned)
    kept: list[LoadedModel] = []  # loaded, oldest first
    out: list[LoadedModel] = []

    def used() -> int:
        return fixed + sum(k.size for k in kept)

    def make_room(need: int, model: str) -> None:
        while budget and used() + need > budget:
            evictable = [k for k in kept if k.name not in pinned]
            check(bool(evictable), "limits.max_models_memory_mb", f"{model!r} holds "
                  f"{need / MIB:.0f} MiB, which does not fit the budget of "
                  f"{budget / MIB:.0f} MiB beside the configured and pinned models' "
                  f"{used() / MIB:.0f} MiB: raise it, or pin fewer")  # fmt: skip
            oldest = evictable[0]
            kept.remove(oldest)
            oldest.engine.close()
            out[out.index(oldest)] = replace(oldest, engine=Unloaded(oldest.engine.info))
            log.info("model_evicted", model=oldest.name, reason="room at start-up",
                     size_mib=round(oldest.size / MIB, 1),
                     used_mib=round(used() / MIB, 1))  # fmt: skip

    try:
        for m in models:
            make_room(resolve_model_path(m.config.path).stat().st_size, m.name)
            one, size = await load_one(m)
            model = LoadedModel(m.name, m.key, m.topics, sized(m, one), one, size, None, True)
            out.append(model)
            model = out[-1] = replace(model, binding=await bind(m.key, model.settings, one))
            metrics.MODEL_MEMORY.labels(model=m.name, version=one.info.version).set(size)
            make_room(size, m.name)
            kept.append(model)
    except BaseException:
        close_models(out)
        raise
    log.info("models_memory", **{k.name: f"{k.size / MIB:.0f} MiB" for k in out},
             loaded=[k.name for k in kept])  # fmt: skip
    return out


async def load_one(m: ServedModel) -> tuple[Engine | GpuEngine, int]:
    """``m``'s engine loaded, and the resident bytes its load added."""
    with settings_named(m.key):
        return await measured(engine_loader(m.settings))


def engine_loader(model: Settings) -> Callable[[], Engine | GpuEngine]:
    """How a model's engine loads (``model``: the worker's settings as the model
    runs alone: its device the worker's), at start-up and again by demand."""
    plan = RunPlan.of(model)
    return functools.partial(
        load_engine, model.model, device=model.gpu.device,
        max_batch_size=model.batching.max_batch_size, cuda_graphs=model.gpu.cuda_graphs,
        buckets=plan.batch_buckets,
    )  # fmt: skip


def close_models(models: Sequence[LoadedModel]) -> None:
    for m in models:
        m.engine.close()
