"""GpuStage: the stage skeleton (``worker.compute.stage``) on a GPU.

Each batch takes a slot (``slots``), and all of its GPU work is enqueued on that
slot's stream in one go by the launcher (``launch``), on a worker thread, so
batches on different slots overlap (one copies in while another computes and a
third copies out). The event loop only awaits completion (``runner``,
``completion``) and scatters rows to requests, copied out of pinned memory
before the slot is released for the next batch. A pipeline's step may hand the
stage whole columns instead (``run_device_columns``, ``columns``).

Inputs: one image input may be preprocessed on the device by the kernels (its
``device = "gpu"``); every other input (tensors, texts' tokens, images
preprocessed on the CPU, constants) is collated on the stage's threads into the
slot's pinned twins and copied in. Rows run together as the binding groups them
(``ModelInputs.groups``): a padded dimension at the smallest warmed bucket that
holds the group's longest row, any other at the rows' own (equal) length.

Encoded images: decoded on the host (Pillow, on the stage's threads), or with
``gpu.decode = "nvjpeg"`` a batch's JPEGs on the device in one call per chunk
(``nvjpeg``; what it refuses on the host, what neither decodes is answered
``invalid_request`` alone), counted by their decoded size from the header.

Memory shared by demand (``worker.app.demand``): the engine and everything the
stage holds on the device for it (``resources``) are freed by ``evict`` and
built again by ``load``, by the constructor's own code; each batch enters the
stage's ``residence`` before it takes a slot, so a batch of an evicted model
waits there for the load, or is answered with why it cannot run.

Failures: out of memory or an engine failure raises ``InferenceFailed`` from
``run_rows``, which runs any subset of a batch's answers again on the same slot
(returning once that slot is idle), so the shared bisection isolates the poison
requests. An unrecoverable device error raises ``EngineDead``: the batch's
future fails, downstream stops committing, and so does every later batch.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog

from worker.compute.engines.base import GpuEngine
from worker.compute.engines.cuda import import_cupy
from worker.compute.gpu import nvjpeg
from worker.compute.gpu.budget import MeasuredBudget, SlotBudget, used_bytes
from worker.compute.gpu.columns import ColumnChunk
from worker.compute.gpu.launch import Chunk
from worker.compute.gpu.plan import check_gpu_inputs, host_kinds
from worker.compute.gpu.resources import DeviceState, RingPlan
from worker.compute.gpu.slots import Allocations, DeviceImage, Slot, SlotRing
from worker.compute.gpu.staging import (
    OnDevice,
    needs_host_work,
    no_bytes,
    prepare_on_host,
    reject_oversized,
    split_chunks,
    staged_bytes,
)
from worker.compute.stage import Residence, Stage, internal_errors_fail_the_run
from worker.compute.triage import ServiceTimeHook, completed, pinned, run_isolating, triage
from worker.config import GpuConfig
from worker.contract import ErrorInfo
from worker.flow.codes import ErrorCode
from worker.flow.messages import Batch, Completed, Job
from worker.flow.room import Room
from worker.model.inputs import Binding
from worker.model.rows import Row

log = structlog.get_logger(__name__)


class GpuStage(Stage):
    def __init__(
        self,
        batches_in: asyncio.Queue[Batch[Job] | None],
        completed_out: asyncio.Queue[asyncio.Future[Completed] | None],
        engine: GpuEngine,
        binding: Binding,
        *,
        max_batch_size: int,
        num_slots: int,
        gpu: GpuConfig,
        preferred_batch_sizes: tuple[int, ...] = (),
        max_attempts: int = 2,
        on_service_time: ServiceTimeHook | None = None,
        room: Room | None = None,
        budget: SlotBudget | None = None,
        cupy: Any = None,
    ) -> None:
        """Allocates every slot now (start-up, not the hot path); may take a while
        (kernel compilation, engine contexts): construct it off the event loop.
        ``binding``: the model's inputs and outputs as the worker bound them;
        ``preferred_batch_sizes``: the batch buckets; ``budget``: the process's
        share of the device, which the slot ring must fit (checked first);
        ``cupy``: CuPy (the default) or its CPU twin (``twin``)."""
        super().__init__(
            batches_in, completed_out, engine.info, binding,
            max_attempts=max_attempts, on_service_time=on_service_time, room=room,
        )  # fmt: skip
        image = check_gpu_inputs(binding.inputs, gpu, num_slots)
        # Before CuPy: a missing torch is named as what gpu.decode needs.
        decoder = (
            nvjpeg.NvJpeg(gpu.device, image.cfg.channels)
            if gpu.decode == "nvjpeg" and image is not None
            else None
        )
        cupy = cupy if cupy is not None else import_cupy()
        self.cupy, self.device = cupy, gpu.device  # where a pipeline's columns are
        self._image = image
        self._host = host_kinds(binding.inputs, image)
        # Packed uint8 bytes one slot stages (GPU preprocessing only). A batch whose
        # images exceed it runs in several chunks; one larger image is too_large.
        self._max_input_bytes = gpu.max_input_bytes if image is not None else None
        self._pool = ThreadPoolExecutor(max_workers=num_slots, thread_name_prefix="gpu")
        self._plan = RingPlan(
            binding, gpu, num_slots, max_batch_size, tuple(preferred_batch_sizes), image,
            self._host, cupy, decoder, self._pool, self._metrics, budget,
        )  # fmt: skip
        # What ``load`` measures itself with: the share's, as it measured the start.
        used: Callable[[], int] = (
            budget.used
            if isinstance(budget, MeasuredBudget)
            else functools.partial(used_bytes, cupy, None, gpu.device)
        )
        self.residence: Residence | None = None  # set where the model is loaded by demand
        try:
            self._state = DeviceState(self._plan, engine, self.info.name, used)
        except BaseException:
            self._pool.shutdown(wait=False)
            raise
        self._adopt()

    def _adopt(self) -> None:
        """What the stage shows of the resources it now runs on."""
        res = self._state.serving()
        self.layout = res.layout  # the ring's, kept through an eviction
        # A pipeline's step may run it on device arrays, its outputs left there.
        self.device_columnar = res.device_columnar

    @property
    def loaded(self) -> bool:
        """Whether the engine and the slots are on the device (not evicted)."""
        return self._state.resources is not None

    @property
    def ring(self) -> SlotRing[Slot]:
        return self._state.serving().ring

    @property
    def slots(self) -> tuple[Slot, ...]:
        res = self._state.resources
        return res.ring.slots if res is not None else ()

    @property
    def allocations(self) -> Allocations:
        """The slots' buffers, counted (none while evicted)."""
        res = self._state.resources
        return res.allocations if res is not None else Allocations()

    @property
    def nvjpeg(self) -> nvjpeg.NvJpeg | None:
        """The device JPEG decoder (``gpu.decode = "nvjpeg"``), with its counts."""
        return self._plan.nvjpeg

    # --- memory shared by demand (worker.app.demand) ------------------------------

    def evict(self) -> None:
        """Free the engine and every slot: the engine's context per slot (torch's
        CUDA graphs, TensorRT's execution contexts: freed on a GPU only, the twin
        has none), the engine, the slots' device and pinned buffers and nvJPEG's
        views of them, the device memory back to the process's allocators
        (``resources``). Only while no batch of this stage runs (the residence
        guarantees it); batches then wait in the residence for ``load``, and one
        that reached the stage regardless is answered ``inference_failed``, never
        run. Idempotent. A failure to free leaves the stage dead (``EngineDead``)."""
        self._state.evict()

    def load(self, engine: GpuEngine) -> int:
        """Serve ``engine`` (the model loaded again: the same file, bound and set
        up as at start-up) on a ring built as the constructor built it
        (``resources.build``: ``engine.prepare``, the launcher, the columns, the
        slots, each slot's context, the kernels). On a GPU that is where torch
        warms and captures its CUDA graphs again and TensorRT creates an
        execution context per slot (and captures with ``gpu.cuda_graphs``); the
        twin has neither. Returns the device bytes it took: the share's used
        after, less before (as ``DeviceShare.measure``; a ring rebuilt in blocks
        the allocator kept measures less than the first start did). On a worker
        thread, while evicted and no batch runs. ``engine`` is the stage's from
        the call: closed where the load fails, which leaves the stage evicted."""
        took = self._state.load(engine)
        self._adopt()
        return took

    # --- the stage ----------------------------------------------------------------

    async def dispatch(self, batch: Batch[Job]) -> asyncio.Future[Completed]:
        """A batch with a request to run takes a slot (waiting for one: the ring's
        bound is the stage's backpressure); one without is answered at once.
        With a residence, the batch enters it first, then takes a slot, on a
        task of its own (the batcher's room bounds the batches dispatched)."""
        loop = asyncio.get_running_loop()
        if self.residence is not None:
            return loop.create_task(self._resident(batch), name=f"gpu-{batch.seq}")
        # Evicted with no residence to load it: a bug, answered as one, never run.
        refused = self._not_loaded() if not self.loaded else None
        res = self._state.serving() if refused is None else None  # raises a dead device's
        if res is None or not any(job.failure is None for job in batch.items):
            done: asyncio.Future[Completed] = loop.create_future()
            done.set_result(self._refused(batch, refused))
            return done
        slot = await res.ring.acquire()
        fut = loop.create_task(self._run_batch(batch, slot), name=f"gpu-{batch.seq}")
        fut.add_done_callback(functools.partial(res.watch.batch_done, slot))
        return fut

    async def _resident(self, batch: Batch[Job]) -> Completed:
        """A batch in the residence: the model held loaded (loaded first) before a
        slot is taken, so a batch it refuses never touches the ring."""
        assert self.residence is not None
        async with self.residence() as why:
            refused = why if why is not None or self.loaded else self._not_loaded()
            if refused is not None or not any(job.failure is None for job in batch.items):
                return self._refused(batch, refused)
            res = self._state.serving()
            slot = await res.ring.acquire()
            try:
                return await self._run_batch(batch, slot)
            finally:
                # Released once its stream is idle. A batch cancelled mid-flight
                # (shutdown) leaves the residence first: an eviction then drains
                # the streams before it frees (``DeviceResources.close``).
                res.watch.batch_done(slot)

    def _not_loaded(self) -> ErrorInfo:
        """A batch reached the stage while it is evicted: a bug (the residence loads
        first), answered as one rather than run."""
        log.error("gpu_stage_not_loaded", model=self.info.name)
        return ErrorInfo(ErrorCode.INFERENCE_FAILED,
                         f"model {self.info.name!r} is not loaded (evicted)")  # fmt: skip

    def _refused(self, batch: Batch[Job], refused: ErrorInfo | None) -> Completed:
        """The batch answered without the engine: its runnable rows with ``refused``
        (its residence's why), any others as triage answers them."""
        rows, runnable = triage(batch, time.monotonic(), self._metrics)
        if refused is not None:
            for row in runnable:
                row.error = refused
        return completed(batch, rows, 0)

    def close(self) -> None:
        """Stop accepting work, wait for in-flight streams and free every slot (the
        engine stays its loader's to close)."""
        self._state.close(self._pool)

    # --- one batch ----------------------------------------------------------------

    async def _run_batch(self, batch: Batch[Job], slot: Slot) -> Completed:
        with structlog.contextvars.bound_contextvars(batch=batch.seq, slot=slot.index):
            res = self._state.serving()
            rows, runnable = triage(batch, time.monotonic(), self._metrics)
            runnable = pinned(runnable, res.engine.info.version)
            on_device: dict[int, DeviceImage] = {}
            if runnable and needs_host_work(runnable, self._host, self._image):
                # Files for the host decoder are decoded and texts tokenized now, on
                # the stage's threads; JPEGs for nvJPEG keep their header's size
                # until their chunk runs.
                loop = asyncio.get_running_loop()
                runnable, on_device = await loop.run_in_executor(
                    self._pool, prepare_on_host, runnable, self._host, self._image,
                    self._plan.nvjpeg is not None,
                )  # fmt: skip
            size = self._sizer(on_device)
            runnable = reject_oversized(runnable, size, self._max_input_bytes)
            engine_rows, service_s = 0, 0.0
            if runnable:
                started = time.monotonic()
                for group in self._inputs.groups(runnable, res.buckets):
                    lengths = self._inputs.bucketed(group, res.buckets)
                    for chunk in split_chunks(group, size, res.max_rows, self._max_input_bytes):
                        engine_rows += await self._run_group(slot, chunk, on_device, lengths)
                service_s = time.monotonic() - started
            return completed(batch, rows, engine_rows, service_s)

    def _sizer(self, on_device: OnDevice) -> Callable[[Row], int]:
        """Bytes an answer's device image takes in the packed staging (0 without one)."""
        if self._image is None:
            return no_bytes
        return functools.partial(staged_bytes, on_device=on_device, name=self._image.name)

    async def _run_group(
        self,
        slot: Slot,
        answers: list[Row],
        on_device: dict[int, DeviceImage],
        lengths: dict[str, int],
    ) -> int:
        """Decode the group's JPEGs on the device (if any), then run it with
        isolation; returns the rows that went to the engine. A group fits the
        slot's staging, so the decoded pixels held at once fit it too."""
        decode_us = 0
        if any(id(a) in on_device for a in answers):
            assert self._image is not None
            runner = self._state.serving().runner
            answers, seconds = await runner.decode(slot, answers, on_device, self._image.name)
            decode_us = round(seconds * 1e6)
        try:
            if answers:
                run = functools.partial(self.run_rows, slot, on_device=on_device, lengths=lengths)
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

    async def run_rows(
        self,
        slot: Slot,
        answers: list[Row],
        on_device: OnDevice | None = None,
        lengths: dict[str, int] | None = None,
    ) -> None:
        """Run ``answers`` on ``slot`` and fill their outputs and timings.

        Splits into chunks that fit the slot (rows and staged bytes); raises
        ``InferenceFailed`` (answers untouched) or ``EngineDead``. Returns only
        when the slot's stream is idle, so the caller may run it again at once.
        ``on_device``: the answers whose JPEG nvJPEG has decoded; ``lengths``:
        the run's length per padded dimension (default: the answers' buckets).
        """
        res = self._state.serving()
        device = on_device or {}
        run_lengths = (
            lengths if lengths is not None else self._inputs.bucketed(answers, res.buckets)
        )
        image = self._image
        chunks = split_chunks(answers, self._sizer(device), res.max_rows, self._max_input_bytes)
        results: list[tuple[list[Row], dict[str, np.ndarray], dict[str, int]]] = []
        for part in chunks:
            images = (
                [device.get(id(a)) or a.values[image.name] for a in part]
                if image is not None
                else []
            )
            outputs, timing = await res.runner.run_chunk(slot, Chunk(part, images, run_lengths))
            results.append((part, outputs, timing))
        # Filled only once every chunk succeeded: a failure leaves all untouched.
        for part, outputs, timing in results:
            self._scatter(part, outputs, res.forms)
            for answer in part:
                answer.timing_us.update(timing)

    def _scatter(
        self, answers: list[Row], outputs: dict[str, np.ndarray], forms: tuple[str, ...]
    ) -> None:
        """Each answer's rows: the device's postprocessed forms as they came back, or
        the host reference on the raw output; outputs cut back to each request's
        lengths (``OutputPlan``)."""
        with internal_errors_fail_the_run():
            if forms:
                on_device = {name: outputs[name] for name in forms}
                self._outputs.scatter(outputs, answers, forms=on_device)
            else:
                self._outputs.scatter(outputs, answers)

    async def run_device_columns(self, arrays: Mapping[str, Any],
                                 ready: Sequence[Any] = ()) -> dict[str, Any] | None:  # fmt: skip
        """A pipeline step's rows as whole-batch arrays (device or host, by request
        input, rows first) through the model on one slot, in runs of what it
        holds: its outputs as device arrays, a row a row (``columns``); None
        where the arrays are not what the model takes. ``ready``: events the
        inputs are complete at. Raises ``InferenceFailed`` or ``EngineDead``. A
        pipeline's step models are never loaded by demand: no residence here."""
        assert self.residence is None, "a pipeline's step model is never evicted"
        res = self._state.serving()
        limit = self._max_input_bytes or 0
        per_run = res.columns.rows_per_run(arrays, res.max_rows, limit)
        if not per_run:
            return None
        n = len(next(iter(arrays.values())))
        out: dict[str, Any] = {}
        slot = await res.ring.acquire()
        try:
            for start in range(0, n, per_run):
                chunk = ColumnChunk(arrays, start, min(n, start + per_run), out, ready)
                await res.runner.run(slot, chunk, res.columns.enqueue)
                self._metrics.batch_size.observe(chunk.stop - start)
        finally:
            res.watch.batch_done(slot)  # released once its stream is idle
        with internal_errors_fail_the_run():
            for name in self._outputs.passed:
                self._outputs.check(name, out[name], n)
        return out
