"""InferenceStage: batches in, completed batches (in dispatch order) out.

Each batch runs preprocess -> engine -> postprocess in a worker thread, so the
event loop never blocks on compute. Up to ``max_inflight`` batches run at once;
their futures go downstream in dispatch order, so the produce stage writes
results in the order the requests were read. Outputs are scattered to requests
by row slices of the batch outputs after checking the row count.
"""

from __future__ import annotations

import asyncio
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import structlog

from . import metrics
from .batching import Batch, BatchPolicy
from .codec import ErrorInfo
from .config import ModelConfig
from .consume import Job
from .engines import Engine
from .errors import InferenceFailed, WorkerError
from .postprocess import postprocess
from .preprocess import batch_shape, preprocess_into
from .streams import end_of_stream

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Answer:
    """The outcome for one job: outputs (one row of each batch output) or an error."""

    job: Job
    outputs: dict[str, np.ndarray] | None = None
    error: ErrorInfo | None = None
    timing_us: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Completed:
    seq: int
    answers: list[Answer]
    engine_rows: int  # requests that actually went through the engine


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


class InferenceStage:
    def __init__(
        self,
        source: asyncio.Queue[Batch[Job] | None],
        sink: asyncio.Queue[asyncio.Future[Completed] | None],
        engine: Engine,
        model: ModelConfig,
        max_batch_size: int,
        max_inflight: int,
        policy: BatchPolicy[Job] | None = None,
        max_attempts: int = 2,
    ) -> None:
        self._max_attempts = max_attempts
        self._source = source
        self._sink = sink
        self._engine = engine
        self._model = model
        self._policy = policy
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="infer")
        # One preallocated input buffer per concurrent batch: nothing is allocated
        # for the model input on the hot path.
        self._buffers: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        shape = batch_shape(model.preprocess, max_batch_size)
        for _ in range(max_inflight):
            self._buffers.put(np.empty(shape, dtype=np.dtype(model.preprocess.dtype)))
        self._raw_name = model.output or engine.info.output_names[0]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with end_of_stream(self._sink):
            while (batch := await self._source.get()) is not None:
                metrics.BATCHES.labels(reason=batch.reason).inc()
                fut = loop.run_in_executor(self._pool, self._run_batch, batch)
                fut.add_done_callback(self._observe)
                metrics.INFLIGHT_BATCHES.inc()
                await self._sink.put(fut)

    def _observe(self, fut: asyncio.Future[Completed]) -> None:
        if self._policy is not None and not fut.cancelled() and fut.exception() is None:
            answers = fut.result().answers
            if answers and answers[0].timing_us:
                t = answers[0].timing_us
                self._policy.observe_service_time(
                    (t.get("preprocess", 0) + t.get("infer", 0)) / 1e6
                )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- runs in a worker thread --------------------------------------------------

    def _run_batch(self, batch: Batch[Job]) -> Completed:
        started = time.monotonic()
        answers = [Answer(job) for job in batch.items]
        runnable: list[Answer] = []
        for answer in answers:
            job = answer.job
            answer.timing_us["queue"] = _us(batch.formed_at - job.arrived)
            if job.failure is not None:
                continue
            if job.deadline is not None and started >= job.deadline:
                # Past its deadline: answered without spending engine time on it.
                answer.error = ErrorInfo("deadline_exceeded", "deadline passed before inference")
                metrics.REQUESTS_REJECTED.labels(code="deadline_exceeded").inc()
                continue
            runnable.append(answer)
        if runnable:
            # Every log line of this batch (failures, isolation) names it. Bound
            # here, in the worker thread: run_in_executor does not carry the
            # event loop's context variables over.
            with structlog.contextvars.bound_contextvars(
                batch=batch.seq, batch_size=len(runnable), flush=batch.reason
            ):
                self._infer(runnable)
        return Completed(seq=batch.seq, answers=answers, engine_rows=len(runnable))

    def _infer(self, answers: list[Answer]) -> None:
        buf = self._buffers.get()
        try:
            self._isolate(answers, buf)
        finally:
            self._buffers.put(buf)

    def _isolate(self, answers: list[Answer], buf: np.ndarray) -> None:
        """Run the batch; when the engine fails on it, split it in halves and run
        each, until the failing requests are alone. A request that fails alone is
        retried up to ``max_attempts`` times, then answered ``inference_failed``;
        everything else in the batch succeeds. At most 2n - 1 + attempts runs."""
        try:
            self._run_rows(answers, buf)
            return
        except InferenceFailed as exc:
            metrics.BATCH_FAILURES.inc()
            log.warning("batch_failed", size=len(answers), error=str(exc))
            failure = exc
        if len(answers) > 1:
            half = len(answers) // 2
            for part in (answers[:half], answers[half:]):
                metrics.ISOLATION_RUNS.inc()
                self._isolate(part, buf)
            return
        job = answers[0].job
        job.attempts += 1
        if job.attempts < self._max_attempts:
            metrics.ISOLATION_RUNS.inc()
            self._isolate(answers, buf)
            return
        answers[0].error = ErrorInfo(failure.code, f"{failure} (after {job.attempts} attempts)")

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
        metrics.BATCH_SIZE.observe(n)
        metrics.PREPROCESS_SECONDS.observe(t1 - t0)
        metrics.INFER_SECONDS.observe(t2 - t1)
        timing = {"preprocess": _us(t1 - t0), "infer": _us(t2 - t1), "d2h": 0}
        for i, a in enumerate(answers):
            a.outputs = {name: arr[i] for name, arr in out.items()}
            a.timing_us.update(timing)
