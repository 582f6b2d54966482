"""A new model version swapped in without leaving the consumer group.

With ``model.reload_interval_s`` > 0 the worker looks at its model file that
often (its content hash: the version results carry). When the content changed,
the new version is loaded beside the serving one, bound to the same settings,
checked and run once, and only then swapped in between batches
(``CpuStage.swap``): batches already running finish on the old version,
every later answer carries the new one. No rebalance happens: the consumer,
its partitions and its offsets are untouched. A version that fails to load,
binds differently (other request inputs: requests already accepted would not
fit it) or drops an output the serving version returns, or fails its self-test
run, is refused (``model_swap_refused``, ``infer_model_swaps_total{outcome}``)
and the old one keeps serving; the worker tries again only when the file
changes again. A rollback is the same operation: put the old file back.

An operator replaces the file atomically (write a temporary file beside it and
rename it over the path; Kubernetes ConfigMap and Secret volumes do so). CPU
path only: the GPU stage's engines are compiled and captured per slot at start
(start-up refuses the setting there).
"""

from __future__ import annotations

import asyncio
from typing import cast

import structlog

from worker.app import cards
from worker.app.probe import self_test
from worker.compute.cpu import CpuStage
from worker.compute.engines import Engine, load_engine
from worker.config import Settings
from worker.flow.errors import WorkerError
from worker.model.files import content_version, resolve_model_path
from worker.model.inputs import Binding, bind_model
from worker.model.inputs.binding import summary
from worker.obs import metrics

log = structlog.get_logger(__name__)


async def watch_model(s: Settings, stage: CpuStage, serving: str, labels: dict[str, str]) -> None:
    """Until cancelled: swap in each new version of the model file that passes
    its checks. ``serving``: the version the worker started with; ``labels``:
    its ``infer_build_info`` labels but the model version."""
    path = resolve_model_path(s.model.path)
    refused: str | None = None
    while True:
        await asyncio.sleep(s.model.reload_interval_s)
        try:
            version = await asyncio.to_thread(content_version, path)
        except OSError as exc:  # mid-replace, or gone: look again next time
            log.warning("model_file_unreadable", path=str(path), error=repr(exc))
            continue
        if version in (serving, refused):
            continue
        problem = await swap(s, stage, version)
        if problem is None:
            swapped(s.model.name, serving, version, labels)
            serving, refused = version, None
        else:
            swap_refused(s.model.name, version, problem, serving)
            refused = version


def swapped(model: str, old: str, new: str, labels: dict[str, str]) -> None:
    """Say a version swapped in: its log line, its metric and build info."""
    metrics.BUILD_INFO.labels(**labels, model_version=old).set(0)
    metrics.BUILD_INFO.labels(**labels, model_version=new).set(1)
    log.info("model_swapped", model=model, old=old, new=new)
    metrics.MODEL_SWAPS.labels(outcome="swapped").inc()


def swap_refused(model: str, version: str, problem: str, serving: str) -> None:
    """Say a version was refused (the serving one goes on)."""
    log.error("model_swap_refused", model=model, version=version, reason=problem,
              serving=serving)  # fmt: skip
    metrics.MODEL_SWAPS.labels(outcome="refused").inc()


async def swap(s: Settings, stage: CpuStage, version: str) -> str | None:
    """Load, bind, check and run the new version, then swap it in; why not, if not."""
    try:
        # The CPU path's engine: RunPlan refuses reloading with a GPU backend.
        engine = cast(Engine, await asyncio.to_thread(load_engine, s.model))
    except (WorkerError, OSError, RuntimeError, ValueError) as exc:
        return f"cannot load: {exc}"
    if engine.info.version != version:
        engine.close()
        return "the file changed again while it was loaded"
    try:
        binding = bind_model(s.model, engine.info.io, s.limits, s.batching)
        problem = compatible(stage.binding, binding) or await asyncio.to_thread(self_test, engine)
    except WorkerError as exc:
        problem = f"does not bind: {exc}"
    if problem is not None:
        engine.close()
        return problem
    old = await stage.swap(engine, binding, version)
    old.close()
    cards.publish(engine.info)  # /v2/models/NAME names the version now serving
    return None


def compatible(serving: Binding, new: Binding) -> str | None:
    """Why requests accepted for ``serving`` could not run on ``new``, or None."""
    if summary(serving.inputs) != summary(new.inputs):
        return (
            f"its request inputs differ: {dict(summary(new.inputs))} against the serving "
            f"{dict(summary(serving.inputs))}"
        )
    dropped = set(serving.outputs.used) - set(new.outputs.used)
    if dropped:
        return f"it lacks outputs the serving version returns: {sorted(dropped)}"
    return None
