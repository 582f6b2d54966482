"""GpuInferenceStage: batches in, completed batches (in dispatch order) out, on a GPU.

The same queue contract as ``worker.infer.InferenceStage``: one future per batch
goes downstream in dispatch order, ``None`` passes end of stream. What differs
is where the work happens. Each batch takes a slot (``worker.buffers``), and all
of its GPU work is enqueued on that slot's stream in one go:

    pack images into pinned staging -> H2D -> preprocess kernel -> engine
    -> softmax/top-k kernel -> D2H into pinned outputs -> event + host callback

so the host never waits between steps and batches on different slots overlap
(one copies in while another computes and a third copies out). The submitting
is done on a worker thread, because packing bytes and a model's launch calls
cost host time; the event loop only awaits the completion callback and then
scatters rows to requests, copying them out of pinned memory before the slot
is released for the next batch.

Completion: a host function enqueued after the last copy
(``Stream.launch_host_func``) hands the loop a wake-up with
``call_soon_threadsafe`` the moment the stream reaches it. Polling the event
instead would add up to a millisecond per batch (asyncio's selector cannot
sleep less than that) or burn a core spinning. The host function must make no
CUDA calls, and this one makes none. CUDA does not call it after a context
error, so a slow poll of the event's status (``cudaEventQuery``, every
``poll_interval_s``) runs behind it as a safety net: it turns a sticky device
error into ``EngineDead``, and a hung device into ``EngineDead`` after
``batch_timeout_s``, rather than a stage that waits for ever.

Failures: out of memory or an engine failure on a batch raises
``InferenceFailed`` from ``run_rows``; the failure hook then decides the
answers. The default (``fail_all``) answers every runnable request
``inference_failed``; ``isolate(max_attempts)`` bisects like the CPU stage
instead, which works because ``run_rows`` runs any subset of a batch's answers
again on the same slot (and returns only once that slot is idle). An
unrecoverable device error raises ``EngineDead``: the batch's future fails,
downstream stops committing, and every later batch fails the same way.

Timings come from CUDA events on the slot's stream: ``preprocess`` = packing
+ H2D + preprocess kernel (host preprocessing + H2D when it runs on the CPU), ``infer`` =
engine + postprocess kernels (the CPU stage also counts postprocessing in
``infer``), ``d2h`` = the copies back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import structlog

from . import kernels, metrics
from .batching import Batch, BatchPolicy
from .buffers import Allocations, Slot, SlotLayout, SlotRing, pack_images
from .codec import ErrorInfo
from .config import ModelConfig
from .consume import Job
from .engines.gpu import (
    GpuEngine,
    TensorSpec,
    event_completed,
    import_cupy,
    translate_gpu_error,
)
from .errors import ConfigError, EngineDead, InferenceFailed, WorkerError
from .infer import Answer, Completed
from .postprocess import postprocess
from .preprocess import batch_shape, preprocess_into
from .streams import end_of_stream

log = structlog.get_logger(__name__)

_H2D: Final = 1  # cudaMemcpyHostToDevice
_D2H: Final = 2  # cudaMemcpyDeviceToHost


@dataclass(frozen=True)
class GpuOptions:
    """How the GPU stage is provisioned; mapped from the worker's config."""

    num_slots: int = 3  # batches in flight on the device at once (one stream each)
    max_batch_size: int = 64  # rows every slot buffer holds
    # Packed uint8 image bytes one slot stages (GPU preprocessing). A batch whose
    # images exceed it runs in several chunks; one image larger than it is
    # answered ``too_large``.
    max_input_bytes: int = 32 * 1024 * 1024
    device: int = 0
    preprocess: Literal["gpu", "cpu"] = "gpu"
    # Safety net behind the completion callback (see the module docstring).
    poll_interval_s: float = 0.05
    batch_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        checks = (
            (self.num_slots >= 1, "gpu.num_slots", "must be >= 1"),
            (self.max_batch_size >= 1, "gpu.max_batch_size", "must be >= 1"),
            (self.max_input_bytes >= 1, "gpu.max_input_bytes", "must be >= 1"),
            (self.device >= 0, "gpu.device", "must be >= 0"),
            (self.preprocess in ("gpu", "cpu"), "model.preprocess.device", "must be gpu or cpu"),
            (self.poll_interval_s > 0, "gpu.poll_interval_s", "must be > 0"),
            (self.batch_timeout_s > 0, "gpu.batch_timeout_s", "must be > 0"),
        )
        for ok, name, message in checks:
            if not ok:
                raise ConfigError(f"{name}: {message}")


RowRunner = Callable[[list[Answer]], Awaitable[None]]
"""Runs answers through the engine on the batch's slot, filling their outputs;
raises ``InferenceFailed`` (nothing filled) or ``EngineDead``."""

FailureHook = Callable[[list[Answer], InferenceFailed, RowRunner], Awaitable[None]]
"""Decides the answers of a batch whose run failed. It may call the runner on
subsets (bisection); answers it leaves without outputs or error are failed."""


async def fail_all(answers: list[Answer], exc: InferenceFailed, rerun: RowRunner) -> None:
    """The default failure hook: every runnable request gets the batch's error."""
    for answer in answers:
        answer.error = ErrorInfo(exc.code, str(exc))


def isolate(max_attempts: int = 2) -> FailureHook:
    """A failure hook that bisects like ``InferenceStage``: split the failed rows in
    halves and run each again on the same slot until the failing requests are
    alone; one that fails alone is retried up to ``max_attempts`` runs in all,
    then answered ``inference_failed``, and everything else in the batch succeeds."""

    async def hook(answers: list[Answer], failure: InferenceFailed, rerun: RowRunner) -> None:
        if len(answers) > 1:
            half = len(answers) // 2
            for part in (answers[:half], answers[half:]):
                metrics.ISOLATION_RUNS.inc()
                await _attempt(part, rerun, hook)
            return
        job = answers[0].job
        job.attempts += 1
        if job.attempts < max_attempts:
            metrics.ISOLATION_RUNS.inc()
            await _attempt(answers, rerun, hook)
            return
        answers[0].error = ErrorInfo(failure.code, f"{failure} (after {job.attempts} attempts)")

    return hook


async def _attempt(answers: list[Answer], rerun: RowRunner, on_failure: FailureHook) -> None:
    try:
        await rerun(answers)
    except InferenceFailed as exc:
        metrics.BATCH_FAILURES.inc()
        log.warning("batch_failed", size=len(answers), error=str(exc))
        await on_failure(answers, exc, rerun)


@dataclass(frozen=True)
class PostprocessPlan:
    """What the device does after the engine, fixed at start-up."""

    raw: TensorSpec  # the engine output that is postprocessed
    topk: int  # columns of the top-k results (0: none)
    gpu_softmax_rows: bool  # probabilities computed on device
    host_postprocess: bool  # raw output comes back and worker.postprocess runs on it
    copy_back: tuple[str, ...]


def postprocess_plan(engine: GpuEngine, model: ModelConfig) -> PostprocessPlan:
    """Decide where postprocessing runs: the kernels on device when they compute
    exactly what worker.postprocess does, else the raw output comes back and the
    NumPy reference runs on the host."""
    raw_name = model.output or engine.info.output_names[0]
    specs = {t.name: t for t in engine.outputs}
    if raw_name not in specs:
        raise ConfigError(f"model.output: {raw_name!r} not in engine outputs {list(specs)}")
    raw = specs[raw_name]
    pp = model.postprocess
    # The kernels reduce over a whole row; the reference's softmax runs over the
    # last axis. They agree when the row is one softmax segment.
    kernel_fits = raw.dtype in (np.float32, np.float16) and (
        math.prod(raw.shape[:-1]) == 1 or not pp.softmax
    )
    wants_device_work = pp.top_k > 0 or pp.softmax
    if wants_device_work and not kernel_fits:
        return PostprocessPlan(raw, 0, False, True, (raw_name,))
    names: list[str] = [raw_name] if pp.include_raw else []
    topk = min(pp.top_k, raw.row_elements) if pp.top_k > 0 else 0
    if topk:
        names += ["topk_indices", "topk_scores"]
    softmax_rows = not topk and pp.softmax
    if softmax_rows:
        names.append("probabilities")
    return PostprocessPlan(raw, topk, softmax_rows, False, tuple(names))


def _us(ms: float) -> int:
    return round(ms * 1e3)


def _wake(arg: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]) -> None:
    """Runs on a CUDA driver thread when the stream reaches it: no CUDA calls here."""
    loop, fut = arg
    # The loop may have closed since the batch was submitted (shutdown): then
    # nobody awaits the future any more and there is nothing to wake.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_resolve, fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class GpuInferenceStage:
    def __init__(
        self,
        source: asyncio.Queue[Batch[Job] | None],
        sink: asyncio.Queue[asyncio.Future[Completed] | None],
        engine: GpuEngine,
        model: ModelConfig,
        max_batch_size: int,
        max_inflight: int,
        policy: BatchPolicy[Job] | None = None,
        *,
        options: GpuOptions | None = None,
        on_failure: FailureHook = fail_all,
    ) -> None:
        """Allocates every slot now (start-up, not the hot path); may take a while
        (kernel compilation, engine contexts): construct it off the event loop."""
        opts = options or GpuOptions(num_slots=max_inflight, max_batch_size=max_batch_size)
        if max_batch_size > opts.max_batch_size:
            raise ConfigError(
                f"batching.max_batch_size ({max_batch_size}) exceeds the GPU slot size "
                f"({opts.max_batch_size})"
            )
        if opts.max_batch_size > engine.max_batch_size:
            raise ConfigError(
                f"batching.max_batch_size ({opts.max_batch_size}) exceeds the engine's "
                f"maximum batch ({engine.max_batch_size})"
            )
        self._cupy = import_cupy()
        self._source = source
        self._sink = sink
        self._engine = engine
        self._model = model
        self._policy = policy
        self._options = opts
        self._on_failure = on_failure
        self._max_rows = opts.max_batch_size
        self._check_input(engine, model)
        self._plan = postprocess_plan(engine, model)
        layout = SlotLayout(
            device=opts.device,
            max_batch_size=max(opts.max_batch_size, engine.min_batch_size),
            engine_input=engine.input,
            engine_outputs=engine.outputs,
            results=self._result_specs(),
            copy_back=self._plan.copy_back,
            max_input_bytes=opts.max_input_bytes if opts.preprocess == "gpu" else 0,
            host_input=opts.preprocess == "cpu",
        )
        self.layout = layout
        self.allocations = Allocations()
        slots: list[Slot] = []
        try:
            for index in range(opts.num_slots):
                slots.append(self._make_slot(layout, index, self.allocations))
            self._warm_kernels()
        except BaseException:
            # Half-started: free what was created (streams, buffers, contexts).
            for slot in slots:
                with contextlib.suppress(Exception):
                    slot.close()
            raise
        self._ring: SlotRing[Slot] = SlotRing(slots, self.allocations)
        # Start-up only: the buffers were zero-filled on the legacy default stream,
        # which the slots' non-blocking streams do not wait for.
        with self._cupy.cuda.Device(opts.device):
            self._cupy.cuda.runtime.deviceSynchronize()
        self._pool = ThreadPoolExecutor(max_workers=opts.num_slots, thread_name_prefix="gpu")
        self._dead: EngineDead | None = None
        self._background: set[asyncio.Task[None]] = set()
        log.info(
            "gpu_stage_ready",
            device=opts.device,
            slots=opts.num_slots,
            rows=layout.max_batch_size,
            device_mib=round(layout.device_bytes * opts.num_slots / 2**20, 1),
            pinned_mib=round(layout.pinned_bytes * opts.num_slots / 2**20, 1),
            preprocess=opts.preprocess,
            postprocess="host" if self._plan.host_postprocess else "gpu",
        )

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self._ring.slots

    # --- start-up ----------------------------------------------------------------

    @staticmethod
    def _check_input(engine: GpuEngine, model: ModelConfig) -> None:
        pp = model.preprocess
        expected = batch_shape(pp, 1)[1:]
        if engine.input.shape != expected or engine.input.dtype != np.dtype(pp.dtype):
            raise ConfigError(
                f"model.preprocess: produces {pp.dtype}{list(expected)} per request but the "
                f"engine input {engine.input.name!r} is {engine.input.dtype}"
                f"{list(engine.input.shape)}"
            )

    def _result_specs(self) -> tuple[TensorSpec, ...]:
        plan = self._plan
        if plan.topk:
            return (
                TensorSpec("topk_indices", np.dtype(np.int64), (plan.topk,)),
                TensorSpec("topk_scores", np.dtype(np.float32), (plan.topk,)),
            )
        if plan.gpu_softmax_rows:
            return (TensorSpec("probabilities", np.dtype(np.float32), plan.raw.shape),)
        return ()

    def _make_slot(self, layout: SlotLayout, index: int, allocations: Allocations) -> Slot:
        slot = Slot.create(index, layout, allocations)
        slot.context = self._engine.create_context(slot)
        return slot

    def _warm_kernels(self) -> None:
        """Compile and load every kernel this stage will launch, now."""
        dev = self._options.device
        if self._options.preprocess == "gpu":
            kernels.load_module(
                "preprocess.cu", kernels.preprocess_defines(self._model.preprocess), dev
            )
        plan = self._plan
        if plan.topk or plan.gpu_softmax_rows:
            pp = self._model.postprocess
            defines = kernels.postprocess_defines(
                plan.raw.row_elements,
                plan.topk or 1,
                pp.softmax if plan.topk else True,
                str(plan.raw.dtype),
            )
            kernels.load_module("postprocess.cu", defines, dev)

    # --- the stage ----------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with end_of_stream(self._sink):
            while (batch := await self._source.get()) is not None:
                if self._dead is not None:
                    raise self._dead
                metrics.BATCHES.labels(reason=batch.reason).inc()
                fut: asyncio.Future[Completed]
                if any(job.failure is None for job in batch.items):
                    slot = await self._ring.acquire()
                    fut = loop.create_task(self._run_batch(batch, slot), name=f"gpu-{batch.seq}")
                    fut.add_done_callback(functools.partial(self._batch_done, slot))
                else:  # nothing to run: answered without a slot
                    fut = loop.create_future()
                    fut.set_result(self._triage(batch, time.monotonic())[1])
                fut.add_done_callback(self._observe)
                metrics.INFLIGHT_BATCHES.inc()
                await self._sink.put(fut)

    def close(self) -> None:
        """Stop accepting work, wait for in-flight streams and free every slot."""
        self._ring.close(self._dead or EngineDead("GPU stage closed"))
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._dead is None:
            with self._cupy.cuda.Device(self._options.device):
                # Drain every stream first, with the GIL released (CuPy's
                # deviceSynchronize is nogil), so each pending completion callback
                # (which takes the GIL) has run. Closing a slot then frees engine
                # context memory (cudaFree synchronises the device) while this thread
                # holds the GIL: a callback still queued on another slot's stream
                # would wait for the GIL for ever, and so would we.
                self._cupy.cuda.runtime.deviceSynchronize()
                for slot in self._ring.slots:
                    slot.close()

    def _observe(self, fut: asyncio.Future[Completed]) -> None:
        if self._policy is not None and not fut.cancelled() and fut.exception() is None:
            answers = fut.result().answers
            timed = next((a.timing_us for a in answers if "infer" in a.timing_us), None)
            if timed:
                seconds = (timed.get("preprocess", 0) + timed.get("infer", 0)) / 1e6
                self._policy.observe_service_time(seconds)

    def _batch_done(self, slot: Slot, task: asyncio.Future[Completed]) -> None:
        """Release the slot once its stream is idle. A batch cancelled while its
        work was in flight keeps the slot until that work has finished."""
        if self._dead is not None:
            return  # the device is gone: the slot is never reused
        if slot.pending is None:
            self._ring.release(slot)
            return
        bg = asyncio.get_running_loop().create_task(self._release_when_idle(slot))
        self._background.add(bg)
        bg.add_done_callback(self._background.discard)

    async def _release_when_idle(self, slot: Slot) -> None:
        assert slot.pending is not None
        submission, woken = slot.pending
        await asyncio.wait((submission,))
        if submission.cancelled() or submission.exception() is not None:
            return  # the submission itself failed: the device is dead (see _run_chunk)
        try:
            await self._await_slot_event(slot, woken)
        except WorkerError as exc:
            log.error("slot_lost", slot=slot.index, error=str(exc))
            return
        slot.pending = None
        self._ring.release(slot)

    # --- one batch ----------------------------------------------------------------

    def _triage(self, batch: Batch[Job], started: float) -> tuple[list[Answer], Completed]:
        """As InferenceStage: failed jobs pass through, expired ones are answered
        ``deadline_exceeded`` without device time; the rest are runnable."""
        answers = [Answer(job) for job in batch.items]
        runnable: list[Answer] = []
        for answer in answers:
            job = answer.job
            answer.timing_us["queue"] = round((batch.formed_at - job.arrived) * 1e6)
            if job.failure is not None:
                continue
            if job.deadline is not None and started >= job.deadline:
                answer.error = ErrorInfo("deadline_exceeded", "deadline passed before inference")
                metrics.REQUESTS_REJECTED.labels(code="deadline_exceeded").inc()
                continue
            runnable.append(answer)
        return runnable, Completed(seq=batch.seq, answers=answers, engine_rows=len(runnable))

    async def _run_batch(self, batch: Batch[Job], slot: Slot) -> Completed:
        with structlog.contextvars.bound_contextvars(batch=batch.seq, slot=slot.index):
            return await self._run_batch_on(batch, slot)

    async def _run_batch_on(self, batch: Batch[Job], slot: Slot) -> Completed:
        runnable, completed = self._triage(batch, time.monotonic())
        runnable = self._reject_oversized(runnable)
        completed.engine_rows = len(runnable)
        if not runnable:
            return completed
        runner: RowRunner = functools.partial(self.run_rows, slot)
        try:
            await runner(runnable)
        except InferenceFailed as exc:
            metrics.BATCH_FAILURES.inc()
            log.warning("batch_failed", size=len(runnable), error=str(exc))
            await self._on_failure(runnable, exc, runner)
            for answer in runnable:
                if answer.outputs is None and answer.error is None:
                    answer.error = ErrorInfo(exc.code, str(exc))
        return completed

    def _reject_oversized(self, answers: list[Answer]) -> list[Answer]:
        if self._options.preprocess != "gpu":
            return answers
        limit = self._options.max_input_bytes
        kept = []
        for answer in answers:
            image = answer.job.image
            assert image is not None
            if image.nbytes > limit:
                answer.error = ErrorInfo(
                    "too_large",
                    f"image of {image.nbytes} bytes exceeds gpu.max_input_bytes {limit}",
                )
                metrics.REQUESTS_REJECTED.labels(code="too_large").inc()
            else:
                kept.append(answer)
        return kept

    async def run_rows(self, slot: Slot, answers: list[Answer]) -> None:
        """Run ``answers`` on ``slot`` and fill their outputs and timings.

        Splits into chunks that fit the slot (rows and staged bytes); raises
        ``InferenceFailed`` (answers untouched) or ``EngineDead``. Returns only
        when the slot's stream is idle, so the caller may run it again at once.
        """
        if self._dead is not None:
            raise self._dead
        results: list[tuple[list[Answer], dict[str, np.ndarray], dict[str, int]]] = []
        for chunk in self._chunks(answers):
            outputs, timing = await self._run_chunk(slot, chunk)
            results.append((chunk, outputs, timing))
        # Filled only once every chunk succeeded: a failure leaves all untouched.
        for chunk, outputs, timing in results:
            for i, answer in enumerate(chunk):
                answer.outputs = {name: arr[i] for name, arr in outputs.items()}
                answer.timing_us.update(timing)

    def _chunks(self, answers: Sequence[Answer]) -> list[list[Answer]]:
        limit = self._options.max_input_bytes if self._options.preprocess == "gpu" else None
        chunks: list[list[Answer]] = []
        current: list[Answer] = []
        used = 0
        for answer in answers:
            image = answer.job.image
            assert image is not None
            size = image.nbytes
            full = len(current) == self._max_rows or (limit is not None and used + size > limit)
            if current and full:
                chunks.append(current)
                current, used = [], 0
            current.append(answer)
            used += size
        if current:
            chunks.append(current)
        return chunks

    async def _run_chunk(
        self, slot: Slot, answers: list[Answer]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        images = [a.job.image for a in answers]
        submission = loop.run_in_executor(self._pool, self._submit, slot, images, (loop, woken))
        # Marked busy before the first await: if this task is cancelled now, the
        # slot is released only after the submission and the stream have finished.
        slot.pending = (submission, woken)
        try:
            host_seconds, error = await asyncio.shield(submission)
        except EngineDead as exc:
            raise self._die(exc) from None
        if isinstance(error, EngineDead):
            raise self._die(error)
        await self._await_slot_event(slot, woken)
        slot.pending = None
        if error is not None:
            raise error
        try:
            outputs, timing = await loop.run_in_executor(
                self._pool, self._collect, slot, len(answers), host_seconds
            )
        except Exception as exc:  # boundary: reading events can report a device error
            raise self._die(translate_gpu_error(exc, f"slot {slot.index}: collect")) from exc
        metrics.BATCH_SIZE.observe(len(answers))
        metrics.PREPROCESS_SECONDS.observe(timing["preprocess"] / 1e6)
        metrics.INFER_SECONDS.observe(timing["infer"] / 1e6)
        return outputs, timing

    async def _await_slot_event(self, slot: Slot, woken: asyncio.Future[None]) -> None:
        """Until the slot's ``finished`` event has completed, without blocking the
        loop: normally the completion callback resolves ``woken``; the event is
        queried every ``poll_interval_s`` in case it never does (see module doc)."""
        opts = self._options
        deadline = time.monotonic() + opts.batch_timeout_s
        while not woken.done():
            await asyncio.wait((woken,), timeout=opts.poll_interval_s)
            if woken.done():
                break
            try:
                # On the slot's device: this (loop) thread's current device may be
                # another one, or have no context yet.
                with self._cupy.cuda.Device(slot.device):
                    completed = event_completed(self._cupy, slot.events.finished)
                if completed:
                    break  # finished; the callback is merely late
            except WorkerError as exc:
                raise self._die(exc) from None
            except Exception as exc:  # boundary: CuPy raises CUDARuntimeError
                raise self._die(translate_gpu_error(exc, f"slot {slot.index}")) from exc
            if time.monotonic() > deadline:
                raise self._die(
                    EngineDead(
                        f"slot {slot.index}: batch still running after {opts.batch_timeout_s}s"
                    )
                )

    def _die(self, error: WorkerError) -> WorkerError:
        if isinstance(error, EngineDead) and self._dead is None:
            self._dead = error
            log.error("gpu_engine_dead", error=str(error))
            self._ring.close(error)
        return error

    # --- worker threads -------------------------------------------------------------

    def _submit(
        self,
        slot: Slot,
        images: list[np.ndarray | None],
        wake: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]],
    ) -> tuple[float, WorkerError | None]:
        """Enqueue the whole chunk on the slot's stream (worker thread).

        Always ends by recording ``finished`` and enqueueing the wake-up, even
        after a failure part-way, so the caller can wait until the stream is idle
        before the slot is reused. Returns the host preprocessing seconds and the
        translated failure, if any; raises ``EngineDead`` when even that fails.
        Touches no asyncio object: the loop decides what a failure means.
        """
        cp = self._cupy
        host_seconds = 0.0
        error: WorkerError | None = None
        with cp.cuda.Device(slot.device):
            try:
                host_seconds = self._enqueue(slot, images)
            except Exception as exc:  # boundary: CuPy / engine library errors
                error = translate_gpu_error(exc, f"slot {slot.index}")
            try:
                slot.events.finished.record(slot.stream)
                slot.stream.launch_host_func(_wake, wake)
            except Exception as exc:  # boundary: not even an event can be recorded
                dead = translate_gpu_error(exc, f"slot {slot.index}: completion")
                raise (dead if isinstance(dead, EngineDead) else EngineDead(str(dead))) from exc
        return host_seconds, error

    def _enqueue(self, slot: Slot, images: list[np.ndarray | None]) -> float:
        cp = self._cupy
        memcpy = cp.cuda.runtime.memcpyAsync
        stream = slot.stream
        ev = slot.events
        n = len(images)
        pp = self._model.preprocess
        host_seconds = 0.0
        if self._options.preprocess == "gpu":
            ev.start.record(stream)  # packing into pinned staging counts as preprocess
            packed, table = slot.host_packed, slot.host_table
            assert packed is not None and table is not None
            offset = pack_images(images, packed, table)  # type: ignore[arg-type]
            memcpy(slot.dev_packed.data.ptr, packed.ctypes.data, offset, _H2D, stream.ptr)
            memcpy(slot.dev_table.data.ptr, table.ctypes.data, n * 3 * 8, _H2D, stream.ptr)
            kernels.preprocess_batch(
                slot.dev_packed, slot.dev_table, n, slot.engine_input,
                cfg=pp, stream=stream, device=slot.device,
            )  # fmt: skip
        else:
            host = slot.host_input
            assert host is not None
            t0 = time.monotonic()
            preprocess_into(images, pp, host)  # type: ignore[arg-type]
            host_seconds = time.monotonic() - t0
            # Recorded after the host work, on the idle stream: start..preprocessed is
            # then the H2D copy alone, and host_seconds is not counted twice.
            ev.start.record(stream)
            nbytes = n * self._engine.input.row_bytes
            memcpy(slot.engine_input.data.ptr, host.ctypes.data, nbytes, _H2D, stream.ptr)
        ev.preprocessed.record(stream)
        self._engine.enqueue(slot, max(n, self._engine.min_batch_size))
        plan = self._plan
        raw = slot.engine_outputs[plan.raw.name]
        post = self._model.postprocess
        if plan.topk:
            kernels.softmax_topk(
                raw, n, slot.results["topk_indices"], slot.results["topk_scores"],
                top_k=plan.topk, softmax=post.softmax, stream=stream, device=slot.device,
            )  # fmt: skip
        elif plan.gpu_softmax_rows:
            kernels.softmax_rows(
                raw, n, slot.results["probabilities"], stream=stream, device=slot.device
            )
        ev.inferred.record(stream)
        for name in plan.copy_back:
            dst = slot.host_results[name]
            src = slot.device_buffer(name)
            memcpy(dst.ctypes.data, src.data.ptr, slot.rows_nbytes(name, n), _D2H, stream.ptr)
        return host_seconds

    def _collect(
        self, slot: Slot, n: int, host_seconds: float
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Copy the chunk's rows out of pinned memory (the slot is reused after
        this) and read the phase times from the slot's events."""
        cp = self._cupy
        plan = self._plan
        outputs: dict[str, np.ndarray]
        if plan.host_postprocess:
            raw = slot.host_results[plan.raw.name][:n].copy()
            outputs = postprocess(raw, self._model.postprocess, plan.raw.name)
        else:
            outputs = {name: slot.host_results[name][:n].copy() for name in plan.copy_back}
        ev = slot.events
        elapsed = cp.cuda.get_elapsed_time
        with cp.cuda.Device(slot.device):  # this worker thread's device may differ
            timing = {
                "preprocess": round(host_seconds * 1e6) + _us(elapsed(ev.start, ev.preprocessed)),
                "infer": _us(elapsed(ev.preprocessed, ev.inferred)),
                "d2h": _us(elapsed(ev.inferred, ev.finished)),
            }
        return outputs, timing


__all__ = [
    "FailureHook",
    "GpuInferenceStage",
    "GpuOptions",
    "PostprocessPlan",
    "RowRunner",
    "fail_all",
    "isolate",
    "postprocess_plan",
]
