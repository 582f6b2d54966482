"""The bundled models' inputs as the worker binds them, for tests that build
stages or jobs without a worker process."""

from __future__ import annotations

import time
from typing import Any

from worker.compute.cpu import CpuStage
from worker.compute.engines import load_engine
from worker.config import BatchingConfig, LimitsConfig, ModelConfig, PreprocessConfig
from worker.contract import Request
from worker.flow.messages import Batch, Completed, Job, TopicPartition
from worker.model.inputs import ModelInputs, bind, bind_model
from worker.model.inputs.image import resolve_declared
from worker.model.preprocess import ImagePreprocess


def model_inputs(
    model: ModelConfig | None = None, limits: LimitsConfig | None = None
) -> ModelInputs:
    """``model``'s request inputs bound to its file (default: the digits model)."""
    cfg = model or ModelConfig()
    engine = load_engine(cfg)
    try:
        return bind(cfg, engine.info.io, limits or LimitsConfig())
    finally:
        engine.close()


def image_pre(**settings: Any) -> ImagePreprocess:
    """Preprocessing from ``[model.preprocess]`` keys, completed as the worker
    completes them; size and channels default to the bundled digits model's
    (8x8, grey), which these tests were written for."""
    cfg = PreprocessConfig(**{"size": (8, 8), "channels": 1, **settings})
    return resolve_declared(cfg, "tests give the size")


def jobs_for(inputs: Any, requests: list[dict[str, Any]]) -> list[Job]:
    jobs = []
    for i, given in enumerate(requests):
        request = Request(v=1, id=f"r{i}", inputs=given)
        values, lengths = inputs.check(request)
        jobs.append(Job(TopicPartition("t", 0), i, None, time.monotonic(), None,
                        request=request, inputs=values, lengths=lengths))  # fmt: skip
    return jobs


def cpu_stage(
    cfg: ModelConfig,
    engine: Any = None,
    batching: BatchingConfig | None = None,
    *,
    batches_in: Any = None,
    completed_out: Any = None,
    max_batch_size: int = 64,
    max_inflight: int = 1,
    max_attempts: int = 2,
) -> CpuStage:
    """A CPU stage over ``engine`` (default: ``cfg``'s, loaded), bound as the
    worker binds it (``bind_model``)."""
    engine = engine if engine is not None else load_engine(cfg)
    binding = bind_model(cfg, engine.info.io, LimitsConfig(), batching)
    return CpuStage(
        batches_in, completed_out, engine, binding,
        max_batch_size=max_batch_size, max_inflight=max_inflight, max_attempts=max_attempts,
    )  # fmt: skip


async def run_stage(
    cfg: ModelConfig,
    requests: list[dict[str, Any]],
    batching: BatchingConfig | None = None,
    runs: list[dict[str, tuple[int, ...]]] | None = None,
) -> Completed:
    """``requests`` as one batch through a CPU stage over ``cfg``'s real engine;
    ``runs`` collects each engine run's feed shapes."""
    engine = load_engine(cfg)
    if runs is not None:
        run = engine.run

        def recorded(feeds: Any) -> Any:
            runs.append({k: tuple(v.shape) for k, v in feeds.items()})
            return run(feeds)

        engine.run = recorded  # type: ignore[method-assign]
    stage = cpu_stage(cfg, engine, batching)
    inputs = stage.binding.inputs
    try:
        return await stage.run_batch(Batch(jobs_for(inputs, requests), time.monotonic(), "full"))
    finally:
        stage.close()
        engine.close()
