"""CpuStage (CPU): batches in, completed batches (in dispatch order) out.

Each batch runs prepare (decode files, tokenize) -> collate -> engine -> outputs
in worker threads, so the event loop never blocks on compute. Up to
``max_inflight`` batches run at once, each with one of as many preallocated
buffers for its fixed-size feeds (images); their futures go downstream in
dispatch order, so the writer writes results in the order the requests
were read. A batch whose rows have free dimensions of different lengths runs as
a few engine calls, grouped by length (``worker.model.inputs``), so padding stays
bounded. Outputs are scattered to requests by row slices of the batch outputs
after checking the row count (``worker.model.outputs``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import structlog

from worker.compute.engines import Engine
from worker.compute.sequences import SequenceStates, waves
from worker.compute.stage import Residence, Stage, internal_errors_fail_the_run
from worker.compute.triage import (
    RowRunner,
    ServiceTimeHook,
    completed,
    micros,
    pinned,
    run_isolating,
    triage,
)
from worker.contract import ErrorInfo
from worker.flow.errors import InferenceFailed
from worker.flow.messages import Batch, Completed, Job, TopicPartition
from worker.flow.room import Room
from worker.model.inputs import Binding, ModelInputs
from worker.model.inputs.image import BoundImage
from worker.model.inputs.tensor import BoundTensor
from worker.model.io import EngineInfo
from worker.model.rows import Row
from worker.obs import metrics

Buffers = dict[str, np.ndarray]

class Unloaded:
    """The engine of a model evicted by demand: its batches wait in the
    residence for a load, so a run here is a bug, said as one."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError(f"{self.info.name}: run while evicted (not loaded)")

    def close(self) -> None:
        pass


def fixed_buffers(inputs: ModelInputs, max_batch_size: int) -> Buffers:
    """One batch's preallocated feeds: the fixed-size ones (images) at the largest
    batch (or the model's fixed batch, if larger); feeds with free dimensions are
    allocated per run, at its lengths."""
    max_batch_size = max(max_batch_size, inputs.batch or 0)
    out: Buffers = {}
    for kind in inputs.kinds:
        if isinstance(kind, BoundImage):
            out[kind.desc.name] = np.empty(
                (max_batch_size, *kind.produced_shape), dtype=np.dtype(kind.cfg.dtype)
            )
    return out


@dataclass(slots=True)
class _Run:
    """One engine run's figures, for the metrics (``CpuStage._record``)."""

    rows: int
    preprocess_s: float
    engine_s: float
    padded: bool = False  # a free dimension ran padded: its elements, real and padding
    data: int = 0
    padding: int = 0


class CpuStage(Stage):
    def __init__(
        self,
        batches_in: asyncio.Queue[Batch[Job] | None],
        completed_out: asyncio.Queue[asyncio.Future[Completed] | None],
        engine: Engine,
        binding: Binding,
        *,
        max_batch_size: int,
        max_inflight: int,
        max_attempts: int = 2,
        on_service_time: ServiceTimeHook | None = None,
        owns: Callable[[Job], bool] = lambda job: True,
        room: Room | None = None,
    ) -> None:
        """``binding``: the model's inputs and outputs as the worker bound them
        (``worker.model.inputs.bind_model``); ``max_inflight``: batches run at once.
        A stateful model's sequence states live here (``compute.sequences``);
        ``owns``: whether a job's partition is still this worker's, as read (the
        offset tracker's answer), which the states ask before a row touches them."""
        super().__init__(
            batches_in, completed_out, engine.info, binding,
            max_attempts=max_attempts, on_service_time=on_service_time, room=room,
        )  # fmt: skip
        self._engine = engine
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="infer")
        # One set of preallocated feed buffers per concurrent batch: nothing is
        # allocated for fixed-size model inputs on the hot path.
        self._buffers: asyncio.Queue[Buffers] = asyncio.Queue()
        for _ in range(max_inflight):
            self._buffers.put_nowait(fixed_buffers(self._inputs, max_batch_size))
        # The most rows one run takes (the buffers' size): a pipeline's step after a
        # fan-out hands in a batch's regions, more rows than that, run in parts.
        self._rows = max(max_batch_size, self._inputs.batch or 0)
        states = binding.inputs.states
        self.sequences = (
            SequenceStates(states, binding.state_ttl_s, binding.max_sequences, owns)
            if states
            else None
        )
        # A stateful model's batches take their turns with the states in the order
        # they were dispatched (each awaits the one before): a key's next request
        # must see the state its previous one left.
        self._turn: asyncio.Future[None] | None = None
        self._inflight = max_inflight
        self.version: str | None = None  # None: the model the worker started with
        self.residence: Residence | None = None  # set where the model is loaded by demand

    @property
    def columnar(self) -> bool:  # type: ignore[override]
        """Stateless, any batch size, every input a tensor of fixed shape and no
        output cut back to a request's length: whole-batch arrays run as they are."""
        inputs = self._inputs
        return (
            self.sequences is None
            and inputs.batch is None
            and not self._outputs.cuts
            and all(isinstance(k, BoundTensor) and k.desc.fixed for k in inputs.kinds)
        )

    def run_columns(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One engine run over whole-batch arrays (rows first, each as its input
        declares: the caller checked), on the caller's thread; the outputs a row
        a request, postprocessed as each request's would be. Recorded in the
        model's metrics as any run."""
        n = len(next(iter(arrays.values())))
        runs: list[_Run] = []
        parts: list[dict[str, np.ndarray]] = []
        try:
            with internal_errors_fail_the_run():
                # In runs of at most max_batch_size rows, as a batch of jobs would run
                # (a step after a fan-out hands in every region of a batch).
                for start in range(0, n, self._rows):
                    feeds = {k.desc.name: arrays[k.name][start : start + self._rows]
                             for k in self._inputs.kinds if isinstance(k, BoundTensor)}  # fmt: skip
                    rows = min(self._rows, n - start)
                    t0 = time.monotonic()
                    raw = self._engine.run(feeds)
                    runs.append(_Run(rows, 0.0, time.monotonic() - t0))
                    parts.append(self._outputs.columns(raw, rows))
                if len(parts) == 1:
                    return parts[0]
                return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        finally:
            self._record(runs)

    async def swap(self, engine: Engine, binding: Binding, version: str) -> Engine:
        """Serve ``engine`` (bound as ``binding``, compatible with the serving one:
        ``worker.app.reload`` checked it) from the next batch on; returns the engine
        it replaced, for the caller to close. Batches already on the old engine
        finish on it: the swap takes every batch's buffer set first, so no batch is
        between taking one and returning it while the engine changes."""
        held = [await self._buffers.get() for _ in range(self._inflight)]
        old = self.install(engine)
        self.binding, self._inputs, self._outputs = binding, binding.inputs, binding.outputs
        self.version = version
        self._metrics = metrics.model_metrics(self._metrics.model, version)
        for buffers in held:
            self._buffers.put_nowait(buffers)
        return old

    def install(self, engine: Engine) -> Engine:
        """Serve ``engine`` (the same version, bound alike: a load by demand, or
        ``Unloaded`` for an eviction) from the next run on; the one it replaced
        returned, for the caller to close. Between batches only: the residence
        holds none while it loads or evicts."""
        old, self._engine = self._engine, engine
        return old

    @property
    def loaded(self) -> bool:
        return not isinstance(self._engine, Unloaded)

    def evict(self) -> None:
        """The engine closed (a model evicted by demand), its description kept."""
        self.install(Unloaded(self.info)).close()

    def load(self, engine: Engine) -> int:
        """``engine`` served again (the same version, loaded by demand); the
        device bytes it took: none (its host memory is measured by the loader)."""
        self.install(engine).close()
        return 0

    async def dispatch(self, batch: Batch[Job]) -> asyncio.Future[Completed]:
        if self.sequences is None:
            return asyncio.ensure_future(self.run_batch(batch))
        before, self._turn = self._turn, asyncio.get_running_loop().create_future()
        return asyncio.ensure_future(self.run_batch(batch, (before, self._turn)))

    async def run_batch(
        self,
        batch: Batch[Job],
        turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]] | None = None,
    ) -> Completed:
        try:
            if self.residence is None:
                return await self._run_batch(batch, turn)
            # Triaged once loaded: a request whose deadline passed while its model
            # loaded is answered deadline_exceeded, as any other.
            async with self.residence() as refused:
                return await self._run_batch(batch, turn, refused)
        finally:
            if turn is not None and not turn[1].done():
                turn[1].set_result(None)

    async def _run_batch(
        self,
        batch: Batch[Job],
        turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]] | None,
        refused: ErrorInfo | None = None,
    ) -> Completed:
        rows, runnable = triage(batch, time.monotonic(), self._metrics)
        if refused is not None:  # the model cannot run now (its residence says why)
            for row in runnable:
                row.error = refused
            return completed(batch, rows, 0)
        if runnable and self._inputs.pending(runnable):
            loop = asyncio.get_running_loop()
            runnable = await loop.run_in_executor(self._pool, self._inputs.prepare, runnable)
        if not runnable:
            return completed(batch, rows, 0)
        if turn is not None and turn[0] is not None:
            # Before taking a buffer: the batch before this one may still need one
            # (its files took longer to prepare), and it must run first.
            await turn[0]
        buffers = await self._buffers.get()
        version = self.version  # the model this batch runs on, swaps notwithstanding
        try:
            runnable = pinned(runnable, version or self._engine.info.version)
            if not runnable:
                return completed(batch, rows, 0)
            # Every log line of this batch (failures, isolation) names it; the
            # binding is local to this batch's task.
            with structlog.contextvars.bound_contextvars(
                batch=batch.seq, batch_size=len(runnable), flush=batch.reason
            ):
                started = time.monotonic()
                if self.sequences is None:
                    await self._run_groups(self._groups(runnable), buffers)
                else:
                    run = functools.partial(self._run_in_thread, buffers)
                    await self._run_sequences(runnable, run)
                service_s = time.monotonic() - started
        finally:
            self._buffers.put_nowait(buffers)
        return completed(batch, rows, len(runnable), service_s, version)

    async def _run_sequences(self, runnable: list[Row], run: RowRunner) -> None:
        """Each wave (one row per sequence) loaded, run and stored before the next."""
        assert self.sequences is not None
        self.sequences.expire_every(time.monotonic())
        for wave in waves(runnable):
            now = time.monotonic()
            loaded = [row for row in wave if self.sequences.load(row, now)]
            if not loaded:
                continue
            for group in self._groups(loaded):
                await run_isolating(group, run, self._max_attempts, self._metrics)
            for row in loaded:
                if row.error is None and row.outputs is not None:
                    self.sequences.store(row)
        metrics.LIVE_SEQUENCES.labels(self._metrics.model).set(len(self.sequences))

    def forget(self, revoked: set[TopicPartition]) -> None:
        if self.sequences is not None:
            self.sequences.forget(revoked)
            metrics.LIVE_SEQUENCES.labels(self._metrics.model).set(len(self.sequences))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def _run_groups(self, groups: list[list[Row]], buffers: Buffers) -> None:
        """Every group's engine run in one hand-over to the thread: a batch of many
        lengths is many small runs, and a hand-over each cost more than the run
        (the tensor drain's batches averaged 1.3 rows a run). A group whose run
        failed is then isolated from the loop, as if it had run alone."""
        loop = asyncio.get_running_loop()
        failures = await loop.run_in_executor(self._pool, self._run_each, groups, buffers)
        run = functools.partial(self._run_in_thread, buffers)
        for group, failure in failures:
            await run_isolating(group, run, self._max_attempts, self._metrics, failure)

    def _groups(self, rows: list[Row]) -> list[list[Row]]:
        """The rows' runs: of one length each (``ModelInputs.groups``), none over
        the buffers' size."""
        n = self._rows
        return [g[k : k + n] for g in self._inputs.groups(rows) for k in range(0, len(g), n)]

    async def _run_in_thread(self, buffers: Buffers, answers: list[Row]) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._run_rows, answers, buffers)

    # --- runs in a worker thread --------------------------------------------------

    def _run_each(
        self, groups: list[list[Row]], buffers: Buffers
    ) -> list[tuple[list[Row], InferenceFailed]]:
        """One engine run per group, in order; the groups whose run failed, with
        why (``EngineDead`` propagates: nothing can run any more). The runs'
        metrics are recorded together, after the last."""
        failed = []
        runs: list[_Run] = []
        try:
            for group in groups:
                try:
                    with internal_errors_fail_the_run():
                        runs.append(self._run_rows_unchecked(group, buffers))
                except InferenceFailed as exc:
                    failed.append((group, exc))
        finally:
            self._record(runs)
        return failed

    def _run_rows(self, answers: list[Row], buffers: Buffers) -> None:
        """One engine run over ``answers``; scatters one row of each output to each
        (the stages' failure boundary around it)."""
        with internal_errors_fail_the_run():
            self._record([self._run_rows_unchecked(answers, buffers)])

    def _record(self, runs: list[_Run]) -> None:
        """Engine runs' metrics, per hand-over rather than per run: a batch of many
        lengths is many runs of a row or two (``observe_all``)."""
        if not runs:
            return
        m = self._metrics
        metrics.observe_all(m.batch_size, [r.rows for r in runs])
        metrics.observe_all(m.preprocess_seconds, [r.preprocess_s for r in runs])
        metrics.observe_all(m.engine_seconds, [r.engine_s for r in runs])
        if any(r.padded for r in runs):
            m.data_elements.inc(sum(r.data for r in runs))
            m.padding_elements.inc(sum(r.padding for r in runs))

    def _run_rows_unchecked(self, answers: list[Row], buffers: Buffers) -> _Run:
        n = len(answers)
        t0 = time.monotonic()
        fixed = self._inputs.batch
        if fixed is None:
            collated = self._inputs.collate(answers, buffers=buffers)
            t1 = time.monotonic()
            self._outputs.scatter(self._engine.run(collated.feeds), answers)
        else:
            # A model of fixed batch runs its rows in runs of that size, the last
            # filled up with its own last row; the filler's answers are dropped.
            collating = 0.0
            for start in range(0, n, fixed):
                part = answers[start : start + fixed]
                filled = part + [part[-1]] * (fixed - len(part))
                c0 = time.monotonic()
                collated = self._inputs.collate(filled, buffers=buffers)
                collating += time.monotonic() - c0
                raw = self._outputs.first_rows(self._engine.run(collated.feeds), len(part), fixed)
                self._outputs.scatter(raw, part)
            t1 = t0 + collating
        t2 = time.monotonic()
        run = _Run(n, t1 - t0, t2 - t1)
        if collated.padded:
            data, total = self._inputs.waste(answers, collated.padded)
            run.padded, run.data, run.padding = True, data, total - data
        timing = {"preprocess": micros(t1 - t0), "infer": micros(t2 - t1), "d2h": 0}
        for a in answers:
            a.timing_us.update(timing)
        return run
