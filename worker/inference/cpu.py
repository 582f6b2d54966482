"""InferenceStage (CPU): batches in, completed batches (in dispatch order) out.

Each batch runs preprocess -> engine -> postprocess in a worker thread, so the
event loop never blocks on compute. Up to ``max_inflight`` batches run at once,
each on one of as many preallocated input buffers; their futures go downstream
in dispatch order, so the produce stage writes results in the order the
requests were read. Outputs are scattered to requests by row slices of the
batch outputs after checking the row count.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import structlog

from worker import metrics
from worker.config import ModelConfig
from worker.engines import Engine
from worker.errors import ConfigError, InferenceFailed, WorkerError
from worker.inference.decode import decode_pending
from worker.inference.postprocess import postprocess
from worker.inference.preprocess import batch_shape, preprocess_into
from worker.inference.triage import (
    ServiceTimeHook,
    micros,
    report_service_time,
    run_isolating,
    triage,
)
from worker.records import Answer, Batch, Completed, Job
from worker.streams import end_of_stream


def check_model_input(engine: Engine, model: ModelConfig) -> None:
    """Refuse to start when preprocessing cannot produce what the model takes
    (every request would otherwise fail at run time, after retries)."""
    declared = engine.info.input_shape
    if declared is None:
        return
    produced = batch_shape(model.preprocess, 1)[1:]
    fits = len(declared) == len(produced) and all(
        d is None or d == p for d, p in zip(declared, produced, strict=True)
    )
    if not fits:
        shown = ["?" if d is None else d for d in declared]
        pp = model.preprocess
        raise ConfigError(
            f"model.preprocess.size: the model's input {engine.info.input_name!r} takes "
            f"[batch, {', '.join(map(str, shown))}] ({pp.layout}) but model.preprocess "
            f"(size {list(pp.size)}, channels {pp.channels}, layout {pp.layout}) produces "
            f"[batch, {', '.join(map(str, produced))}]"
        )


class InferenceStage:
    def __init__(
        self,
        source: asyncio.Queue[Batch[Job] | None],
        sink: asyncio.Queue[asyncio.Future[Completed] | None],
        engine: Engine,
        model: ModelConfig,
        max_batch_size: int,
        max_inflight: int,
        *,
        max_attempts: int = 2,
        on_service_time: ServiceTimeHook | None = None,
    ) -> None:
        check_model_input(engine, model)
        self._source = source
        self._sink = sink
        self._engine = engine
        self._model = model
        self._max_attempts = max_attempts
        self._report = report_service_time(on_service_time)
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="infer")
        # One preallocated input buffer per concurrent batch: nothing is allocated
        # for the model input on the hot path.
        self._buffers: asyncio.Queue[np.ndarray] = asyncio.Queue()
        shape = batch_shape(model.preprocess, max_batch_size)
        for _ in range(max_inflight):
            self._buffers.put_nowait(np.empty(shape, dtype=np.dtype(model.preprocess.dtype)))
        self._raw_name = model.output or engine.info.output_names[0]
        self._metrics = metrics.ModelMetrics(engine.info.name, engine.info.version)

    async def run(self) -> None:
        async with end_of_stream(self._sink):
            while (batch := await self._source.get()) is not None:
                self._metrics.batches(batch.reason).inc()
                fut = asyncio.ensure_future(self.run_batch(batch))
                fut.add_done_callback(self._report)
                metrics.INFLIGHT_BATCHES.inc()
                await self._sink.put(fut)

    async def run_batch(self, batch: Batch[Job]) -> Completed:
        completed, runnable = triage(batch, time.monotonic(), self._metrics)
        if any(a.job.encoded is not None for a in runnable):
            loop = asyncio.get_running_loop()
            pp, name = self._model.preprocess, self._model.input
            runnable = await loop.run_in_executor(
                self._pool, decode_pending, runnable, pp.channels, name
            )
            completed.engine_rows = len(runnable)
        if not runnable:
            return completed
        buf = await self._buffers.get()
        try:
            # Every log line of this batch (failures, isolation) names it; the
            # binding is local to this batch's task.
            with structlog.contextvars.bound_contextvars(
                batch=batch.seq, batch_size=len(runnable), flush=batch.reason
            ):
                started = time.monotonic()
                run = functools.partial(self._run_in_thread, buf)
                await run_isolating(runnable, run, self._max_attempts, self._metrics)
                completed.service_s = time.monotonic() - started
        finally:
            self._buffers.put_nowait(buf)
        return completed

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def _run_in_thread(self, buf: np.ndarray, answers: list[Answer]) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._run_rows, answers, buf)

    # --- runs in a worker thread --------------------------------------------------

    def _run_rows(self, answers: list[Answer], buf: np.ndarray) -> None:
        """One engine run over ``answers``; scatters one row of each output to each.

        Anything but our own errors raised here (a preprocessing or postprocessing
        bug tripped by one odd request) is translated into ``InferenceFailed``, so it
        is isolated like an engine failure instead of killing the worker, which
        would then crash-loop on the same record."""
        try:
            self._run_rows_unchecked(answers, buf)
        except WorkerError:
            raise
        except Exception as exc:
            raise InferenceFailed(f"internal error: {exc!r}") from exc

    def _run_rows_unchecked(self, answers: list[Answer], buf: np.ndarray) -> None:
        n = len(answers)
        t0 = time.monotonic()
        images = [a.job.image for a in answers]
        assert all(img is not None for img in images)
        batch = preprocess_into(images, self._model.preprocess, buf)  # type: ignore[arg-type]
        t1 = time.monotonic()
        raw = self._engine.run(batch)
        out = postprocess(raw[self._raw_name], self._model.postprocess, self._raw_name)
        for name, arr in out.items():
            if arr.shape[0] != n:  # a model that does not return a row per request
                raise InferenceFailed(f"output {name} has {arr.shape[0]} rows for {n} requests")
        t2 = time.monotonic()
        m = self._metrics
        m.batch_size.observe(n)
        m.preprocess_seconds.observe(t1 - t0)
        m.engine_seconds.observe(t2 - t1)
        timing = {"preprocess": micros(t1 - t0), "infer": micros(t2 - t1), "d2h": 0}
        for i, a in enumerate(answers):
            a.outputs = {name: arr[i] for name, arr in out.items()}
            a.timing_us.update(timing)
