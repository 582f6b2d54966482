"""GpuInferenceStage: batches in, completed batches (in dispatch order) out, on a GPU.

The same queue contract as the CPU stage (``worker.inference.cpu``): one future
per batch goes downstream in dispatch order, ``None`` passes end of stream; the
same triage and poison isolation (``worker.inference.triage``). What differs is
where the work happens. Each batch takes a slot (``slots``), and all of its GPU
work is enqueued on that slot's stream in one go by the launcher (``launch``),
on a worker thread, so batches on different slots overlap (one copies in while
another computes and a third copies out). The event loop only awaits completion
and scatters rows to requests, copied out of pinned memory before the slot is
released for the next batch.

Completion: a host function enqueued after the last copy
(``Stream.launch_host_func``) hands the loop a wake-up with
``call_soon_threadsafe`` the moment the stream reaches it. Polling the event
instead would add up to a millisecond per batch (asyncio's selector cannot
sleep less than that) or burn a core spinning. CUDA does not call it after a
context error, so a slow poll of the event's status (``cudaEventQuery``, every
``gpu.poll_interval_ms``) runs behind it as a safety net: it turns a sticky
device error into ``EngineDead``, and a hung device into ``EngineDead`` after
``gpu.batch_timeout_ms``, rather than a stage that waits for ever.

Encoded images: PNG and WebP files are decoded on the host (Pillow, on the
stage's threads) before the batch is staged, like JPEGs with ``gpu.decode =
"host"``. With ``"nvjpeg"`` a batch's JPEGs are decoded on the device in one
call per chunk (``nvjpeg``) while the slot's stream is idle, and copied into the
slot's device staging; a JPEG nvJPEG refuses is decoded on the host instead,
and a file neither can decode is answered ``invalid_request`` alone. The staging
byte budget counts a JPEG by its decoded size, read from its header.

Failures: out of memory or an engine failure on a batch raises
``InferenceFailed`` from ``run_rows``, which runs any subset of a batch's
answers again on the same slot (and returns only once that slot is idle), so
the shared bisection isolates the poison requests. An unrecoverable device
error raises ``EngineDead``: the batch's future fails, downstream stops
committing, and every later batch fails the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import structlog

from worker import metrics
from worker.config import GpuConfig, LimitsConfig, ModelConfig
from worker.contract import EncodedImage, ErrorInfo
from worker.engines.base import GpuEngine
from worker.engines.cuda import event_completed, import_cupy, translate_gpu_error
from worker.errors import ConfigError, EngineDead, WorkerError
from worker.inference.decode import decode_pending
from worker.inference.gpu import nvjpeg
from worker.inference.gpu.launch import Launcher
from worker.inference.gpu.plan import check_engine_input, postprocess_plan
from worker.inference.gpu.slots import (
    Allocations,
    DeviceImage,
    Slot,
    SlotLayout,
    SlotRing,
    StagedImage,
)
from worker.inference.triage import ServiceTimeHook, report_service_time, run_isolating, triage
from worker.inputs import ModelInputs, bind, is_classifier
from worker.records import Answer, Batch, Completed, Job
from worker.streams import end_of_stream

log = structlog.get_logger(__name__)


def _check_sizes(engine: GpuEngine, model: ModelConfig, max_batch_size: int, slots: int) -> None:
    if max_batch_size > engine.max_batch_size:
        raise ConfigError(
            f"batching.max_batch_size ({max_batch_size}) exceeds the engine's "
            f"maximum batch ({engine.max_batch_size})"
        )
    if slots < 1:
        raise ConfigError("gpu.num_slots: must be >= 1")
    check_engine_input(engine, model)


# --- staging budget: pure, so unit-tested without a GPU ------------------------------

OnDevice = Mapping[int, DeviceImage]
"""The answers (by ``id``) whose JPEG nvJPEG decodes, with its image."""


def staged_bytes(answer: Answer, on_device: OnDevice, name: str = "image") -> int:
    """Bytes the answer's image (request input ``name``) takes in the packed
    staging: a JPEG for nvJPEG by the size its header gives, before it is decoded."""
    image = on_device.get(id(answer))
    if image is not None:
        return image.nbytes
    pixels = answer.job.inputs[name]
    assert isinstance(pixels, np.ndarray)
    return int(pixels.nbytes)


def reject_oversized(
    answers: list[Answer], size: Callable[[Answer], int], limit: int | None
) -> list[Answer]:
    """Answer ``too_large`` each image that alone exceeds the slot's staging."""
    if limit is None:
        return answers
    kept = []
    for answer in answers:
        nbytes = size(answer)
        if nbytes > limit:
            answer.error = ErrorInfo(
                "too_large", f"image of {nbytes} bytes exceeds gpu.max_input_bytes {limit}"
            )
            metrics.REQUESTS_REJECTED.labels(code="too_large").inc()
        else:
            kept.append(answer)
    return kept


def split_chunks(
    answers: Sequence[Answer], size: Callable[[Answer], int], max_rows: int, limit: int | None
) -> list[list[Answer]]:
    """Consecutive chunks of at most ``max_rows`` answers and ``limit`` staged bytes."""
    chunks: list[list[Answer]] = []
    current: list[Answer] = []
    used = 0
    for answer in answers:
        nbytes = size(answer)
        full = len(current) == max_rows or (limit is not None and used + nbytes > limit)
        if current and full:
            chunks.append(current)
            current, used = [], 0
        current.append(answer)
        used += nbytes
    if current:
        chunks.append(current)
    return chunks


def route_encoded(
    answers: list[Answer], channels: int, use_nvjpeg: bool, name: str = "image"
) -> tuple[list[Answer], dict[int, DeviceImage]]:
    """Split the answers whose image (request input ``name``) is a file: those for
    the host decoder, and the JPEGs nvJPEG takes (by ``id``, with their header's
    size)."""
    to_host: list[Answer] = []
    on_device: dict[int, DeviceImage] = {}
    for answer in answers:
        encoded = answer.job.inputs.get(name)
        if not isinstance(encoded, EncodedImage):
            continue
        image = nvjpeg.device_image(encoded, channels) if use_nvjpeg else None
        if image is None:
            to_host.append(answer)
        else:
            on_device[id(answer)] = image
    return to_host, on_device


class GpuInferenceStage:
    def __init__(
        self,
        source: asyncio.Queue[Batch[Job] | None],
        sink: asyncio.Queue[asyncio.Future[Completed] | None],
        engine: GpuEngine,
        model: ModelConfig,
        max_batch_size: int,
        num_slots: int,
        gpu: GpuConfig | None = None,
        *,
        inputs: ModelInputs | None = None,
        max_attempts: int = 2,
        on_service_time: ServiceTimeHook | None = None,
    ) -> None:
        """Allocates every slot now (start-up, not the hot path); may take a while
        (kernel compilation, engine contexts): construct it off the event loop."""
        gpu = gpu or GpuConfig()
        _check_sizes(engine, model, max_batch_size, num_slots)
        nvjpeg.check_config(gpu.decode, model.preprocess)
        # Before CuPy: a missing torch is named as what gpu.decode needs.
        self._nvjpeg = (
            nvjpeg.NvJpeg(gpu.device, model.preprocess.channels) if gpu.decode == "nvjpeg" else None
        )
        self._cupy = import_cupy()
        self._source = source
        self._sink = sink
        self._engine = engine
        self._device = gpu.device
        self._max_rows = max_batch_size
        self._max_attempts = max_attempts
        self._channels = model.preprocess.channels
        self._input_name = model.input
        self._report = report_service_time(on_service_time)
        self._metrics = metrics.ModelMetrics(engine.info.name, engine.info.version)
        self._poll_interval_s = gpu.poll_interval_ms / 1000.0
        self._batch_timeout_s = gpu.batch_timeout_ms / 1000.0
        gpu_preprocess = model.preprocess.device == "gpu"
        # Packed uint8 bytes one slot stages (GPU preprocessing only). A batch whose
        # images exceed it runs in several chunks; one larger image is too_large.
        self._max_input_bytes = gpu.max_input_bytes if gpu_preprocess else None
        inputs = inputs if inputs is not None else bind(model, engine.info.io, LimitsConfig())
        post = model.postprocess.resolved(is_classifier(inputs))
        plan = postprocess_plan(engine, model, post)
        self._launcher = Launcher(self._cupy, engine, model, plan, self._nvjpeg)
        self.layout = SlotLayout(
            device=gpu.device,
            max_batch_size=max(max_batch_size, engine.min_batch_size),
            engine_input=engine.input,
            engine_outputs=engine.outputs,
            results=plan.result_specs,
            copy_back=plan.copy_back,
            max_input_bytes=gpu.max_input_bytes if gpu_preprocess else 0,
            host_input=not gpu_preprocess,
        )
        self.allocations = Allocations()
        self._metrics.gpu_slots.set(num_slots)
        self._ring: SlotRing[Slot] = SlotRing(
            self._make_slots(num_slots), self.allocations, self._metrics.gpu_slots_busy.set
        )
        self._pool = ThreadPoolExecutor(max_workers=num_slots, thread_name_prefix="gpu")
        self._dead: EngineDead | None = None
        self._background: set[asyncio.Task[None]] = set()
        log.info(
            "gpu_stage_ready",
            device=gpu.device,
            slots=num_slots,
            rows=self.layout.max_batch_size,
            device_mib=round(self.layout.device_bytes * num_slots / 2**20, 1),
            pinned_mib=round(self.layout.pinned_bytes * num_slots / 2**20, 1),
            preprocess=model.preprocess.device,
            decode=gpu.decode,
            postprocess="host" if plan.host_postprocess else "gpu",
        )

    def _make_slots(self, count: int) -> list[Slot]:
        slots: list[Slot] = []
        try:
            for index in range(count):
                slot = Slot.create(index, self.layout, self.allocations)
                slots.append(slot)
                slot.context = self._engine.create_context(slot)
                if self._nvjpeg is not None:
                    self._nvjpeg.attach(slot)
            self._launcher.warm_kernels(self._device)
            # Start-up only: the buffers were zero-filled on the legacy default
            # stream, which the slots' non-blocking streams do not wait for.
            with self._cupy.cuda.Device(self._device):
                self._cupy.cuda.runtime.deviceSynchronize()
        except BaseException:
            # Half-started: free what was created (streams, buffers, contexts).
            for slot in slots:
                with contextlib.suppress(Exception):
                    slot.close()
            raise
        return slots

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self._ring.slots

    @property
    def nvjpeg(self) -> nvjpeg.NvJpeg | None:
        """The device JPEG decoder (``gpu.decode = "nvjpeg"``), with its counts."""
        return self._nvjpeg

    # --- the stage ----------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with end_of_stream(self._sink):
            while (batch := await self._source.get()) is not None:
                if self._dead is not None:
                    raise self._dead
                self._metrics.batches(batch.reason).inc()
                fut: asyncio.Future[Completed]
                if any(job.failure is None for job in batch.items):
                    slot = await self._ring.acquire()
                    fut = loop.create_task(self._run_batch(batch, slot), name=f"gpu-{batch.seq}")
                    fut.add_done_callback(functools.partial(self._batch_done, slot))
                else:  # nothing to run: answered without a slot
                    fut = loop.create_future()
                    fut.set_result(triage(batch, time.monotonic(), self._metrics)[0])
                fut.add_done_callback(self._report)
                metrics.INFLIGHT_BATCHES.inc()
                await self._sink.put(fut)

    def close(self) -> None:
        """Stop accepting work, wait for in-flight streams and free every slot."""
        self._ring.close(self._dead or EngineDead("GPU stage closed"))
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._dead is None:
            with self._cupy.cuda.Device(self._device):
                # Drain every stream first, with the GIL released (CuPy's
                # deviceSynchronize is nogil), so each pending completion callback
                # (which takes the GIL) has run. Closing a slot then frees engine
                # context memory (cudaFree synchronises the device) while this thread
                # holds the GIL: a callback still queued on another slot's stream
                # would wait for the GIL for ever, and so would we.
                self._cupy.cuda.runtime.deviceSynchronize()
                for slot in self._ring.slots:
                    slot.close()
        if self._nvjpeg is not None:
            self._nvjpeg.close()

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

    async def _run_batch(self, batch: Batch[Job], slot: Slot) -> Completed:
        with structlog.contextvars.bound_contextvars(batch=batch.seq, slot=slot.index):
            completed, runnable = triage(batch, time.monotonic(), self._metrics)
            on_device: dict[int, DeviceImage] = {}
            name = self._input_name
            if any(isinstance(a.job.inputs.get(name), EncodedImage) for a in runnable):
                # Files for the host decoder are decoded now, on the stage's threads;
                # JPEGs for nvJPEG keep their header's size until their chunk runs.
                loop = asyncio.get_running_loop()
                runnable, on_device = await loop.run_in_executor(
                    self._pool, self._decode_on_host, runnable
                )
            size = functools.partial(staged_bytes, on_device=on_device, name=name)
            runnable = reject_oversized(runnable, size, self._max_input_bytes)
            completed.engine_rows = 0
            if runnable:
                started = time.monotonic()
                for chunk in split_chunks(runnable, size, self._max_rows, self._max_input_bytes):
                    completed.engine_rows += await self._run_group(slot, chunk, on_device)
                completed.service_s = time.monotonic() - started
            return completed

    def _decode_on_host(self, answers: list[Answer]) -> tuple[list[Answer], dict[int, DeviceImage]]:
        """On a stage thread: decode the files nvJPEG does not take; returns the
        answers that can run and the JPEGs left for nvJPEG."""
        to_host, on_device = route_encoded(
            answers, self._channels, self._nvjpeg is not None, self._input_name
        )
        if to_host:
            decode_pending(to_host, self._channels, self._input_name)  # failures: answered
        return [a for a in answers if a.error is None], on_device

    async def _run_group(
        self, slot: Slot, answers: list[Answer], on_device: dict[int, DeviceImage]
    ) -> int:
        """Decode the group's JPEGs on the device (if any), then run it with
        isolation; returns the rows that went to the engine. A group fits the
        slot's staging, so the decoded pixels held at once fit it too."""
        decode_us = 0
        if any(id(a) in on_device for a in answers):
            answers, seconds = await self._decode_on_device(slot, answers, on_device)
            decode_us = round(seconds * 1e6)
        try:
            if answers:
                run = functools.partial(self.run_rows, slot, on_device=on_device)
                await run_isolating(answers, run, self._max_attempts, self._metrics)
        finally:
            # run_rows returned with the slot's stream idle (or the device is
            # gone): the decoded pixels can go back to torch's pool.
            for answer in answers:
                image = on_device.pop(id(answer), None)
                if image is not None:
                    image.pixels = None
        if decode_us:
            for answer in answers:
                if answer.outputs is not None:
                    answer.timing_us["preprocess"] += decode_us
        return len(answers)

    async def _decode_on_device(
        self, slot: Slot, answers: list[Answer], on_device: dict[int, DeviceImage]
    ) -> tuple[list[Answer], float]:
        """nvJPEG on a stage thread, the slot marked busy meanwhile (a cancelled
        batch releases it only once the decode has returned)."""
        loop = asyncio.get_running_loop()
        decoding = loop.run_in_executor(self._pool, self._decode_group, slot, answers, on_device)
        idle: asyncio.Future[None] = loop.create_future()
        idle.set_result(None)  # the decode leaves nothing queued on the slot's stream
        slot.pending = (decoding, idle)
        try:
            result = await asyncio.shield(decoding)
        except EngineDead as exc:
            slot.pending = None
            raise self._die(exc) from None
        except BaseException:
            if decoding.done():
                slot.pending = None
            raise
        slot.pending = None
        return result

    def _decode_group(
        self, slot: Slot, answers: list[Answer], on_device: dict[int, DeviceImage]
    ) -> tuple[list[Answer], float]:
        """On a stage thread: one batched nvJPEG call for the group's JPEGs; those it
        refuses go to the host decoder. Returns the answers that can run."""
        assert self._nvjpeg is not None
        jpegs = [a for a in answers if id(a) in on_device]
        started = time.monotonic()
        problems = self._nvjpeg.decode(slot, [on_device[id(a)] for a in jpegs])
        seconds = time.monotonic() - started
        refused: list[Answer] = []
        for answer, problem in zip(jpegs, problems, strict=True):
            if problem is None:
                continue  # its pixels are on the device (``on_device``)
            del on_device[id(answer)]
            refused.append(answer)
            log.debug("nvjpeg_refused", offset=answer.job.offset, reason=problem)
        if refused:
            decode_pending(refused, self._channels, self._input_name)
        return [a for a in answers if a.error is None], seconds

    async def run_rows(
        self, slot: Slot, answers: list[Answer], on_device: OnDevice | None = None
    ) -> None:
        """Run ``answers`` on ``slot`` and fill their outputs and timings.

        Splits into chunks that fit the slot (rows and staged bytes); raises
        ``InferenceFailed`` (answers untouched) or ``EngineDead``. Returns only
        when the slot's stream is idle, so the caller may run it again at once.
        ``on_device``: the answers whose JPEG nvJPEG has decoded.
        """
        if self._dead is not None:
            raise self._dead
        device = on_device or {}
        size = functools.partial(staged_bytes, on_device=device, name=self._input_name)
        results: list[tuple[list[Answer], dict[str, np.ndarray], dict[str, int]]] = []
        for chunk in split_chunks(answers, size, self._max_rows, self._max_input_bytes):
            images: list[StagedImage] = []
            for answer in chunk:
                image = device.get(id(answer))
                pixels = answer.job.inputs[self._input_name] if image is None else image
                assert pixels is not None
                images.append(pixels)
            outputs, timing = await self._run_chunk(slot, images)
            results.append((chunk, outputs, timing))
        # Filled only once every chunk succeeded: a failure leaves all untouched.
        for chunk, outputs, timing in results:
            for i, answer in enumerate(chunk):
                answer.outputs = {name: arr[i] for name, arr in outputs.items()}
                answer.timing_us.update(timing)

    async def _run_chunk(
        self, slot: Slot, images: list[StagedImage]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        launcher = self._launcher
        submission = loop.run_in_executor(self._pool, launcher.submit, slot, images, (loop, woken))
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
                self._pool, launcher.collect, slot, len(images), host_seconds
            )
        except Exception as exc:  # boundary: reading events can report a device error
            raise self._die(translate_gpu_error(exc, f"slot {slot.index}: collect")) from exc
        m = self._metrics
        m.batch_size.observe(len(images))
        m.preprocess_seconds.observe(timing["preprocess"] / 1e6)
        m.engine_seconds.observe(timing["infer"] / 1e6)
        m.d2h_seconds.observe(timing["d2h"] / 1e6)
        return outputs, timing

    async def _await_slot_event(self, slot: Slot, woken: asyncio.Future[None]) -> None:
        """Until the slot's ``finished`` event has completed, without blocking the
        loop: normally the completion callback resolves ``woken``; the event is
        queried every poll interval in case it never does (see module doc)."""
        deadline = time.monotonic() + self._batch_timeout_s
        while not woken.done():
            await asyncio.wait((woken,), timeout=self._poll_interval_s)
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
                        f"slot {slot.index}: batch still running after {self._batch_timeout_s}s"
                    )
                )

    def _die(self, error: WorkerError) -> WorkerError:
        if isinstance(error, EngineDead) and self._dead is None:
            self._dead = error
            log.error("gpu_engine_dead", error=str(error))
            self._ring.close(error)
        return error
