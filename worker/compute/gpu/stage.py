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

Failures: out of memory or an engine failure raises ``InferenceFailed`` from
``run_rows``, which runs any subset of a batch's answers again on the same slot
(returning once that slot is idle), so the shared bisection isolates the poison
requests. An unrecoverable device error raises ``EngineDead``: the batch's
future fails, downstream stops committing, and so does every later batch.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from worker.compute.gpu.budget import SlotBudget
from worker.compute.gpu.columns import ColumnChunk, Columns, columnar_on_device
from worker.compute.gpu.completion import SlotWatch
from worker.compute.gpu.launch import Chunk, Launcher
from worker.compute.gpu.plan import (
    check_gpu_inputs,
    host_kinds,
    postprocess_plan,
    slot_shapes,
)
from worker.compute.gpu.runner import SlotRunner
from worker.compute.gpu.slots import Allocations, DeviceImage, Slot, SlotLayout, SlotRing
from worker.compute.gpu.staging import (
    OnDevice,
    needs_host_work,
    no_bytes,
    prepare_on_host,
    reject_oversized,
    split_chunks,
    staged_bytes,
)
from worker.compute.stage import Stage, internal_errors_fail_the_run
from worker.compute.triage import ServiceTimeHook, completed, pinned, run_isolating, triage
from worker.config import GpuConfig
from worker.flow.errors import EngineDead
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
        inputs = binding.inputs
        image = check_gpu_inputs(inputs, gpu, num_slots)
        # A batch larger than the engine takes runs in chunks of its maximum (a
        # model of fixed batch: chunks of exactly that, padded up by the buckets).
        max_batch_size = min(max_batch_size, engine.max_batch_size)
        # Before CuPy: a missing torch is named as what gpu.decode needs.
        self._nvjpeg = (
            nvjpeg.NvJpeg(gpu.device, image.cfg.channels)
            if gpu.decode == "nvjpeg" and image is not None
            else None
        )
        self._cupy = cupy if cupy is not None else import_cupy()
        self.cupy, self.device = self._cupy, gpu.device  # where a pipeline's columns are
        self._engine = engine
        self._image = image
        self._host = host_kinds(inputs, image)
        self._device = gpu.device
        self._max_rows = max_batch_size
        # Packed uint8 bytes one slot stages (GPU preprocessing only). A batch whose
        # images exceed it runs in several chunks; one larger image is too_large.
        self._max_input_bytes = gpu.max_input_bytes if image is not None else None
        preferred = tuple(p for p in preferred_batch_sizes if p <= max_batch_size)
        shapes = slot_shapes(
            inputs, max_batch_size, preferred, inputs.length_buckets,
            engine.min_batch_size,
        )  # fmt: skip
        self._buckets = dict(shapes.lengths)
        engine.prepare(shapes)
        plan = postprocess_plan(engine, self._outputs)
        self._forms = plan.forms
        self._launcher = Launcher(self._cupy, engine, inputs, image, self._host, plan, self._nvjpeg)
        self._columns = Columns(self._cupy, engine, inputs, image, plan, self._outputs,
                                self._launcher)  # fmt: skip
        # A pipeline's step may run it on device arrays, its outputs left there.
        self.device_columnar = columnar_on_device(inputs, self._outputs, plan, image)
        self.layout = SlotLayout(
            device=gpu.device,
            max_batch_size=shapes.batches[-1],
            engine_inputs=engine.inputs,
            engine_outputs=engine.outputs,
            results=plan.result_specs,
            copy_back=plan.copy_back,
            max_input_bytes=gpu.max_input_bytes if image is not None else 0,
            host_inputs=tuple(f.name for k in (*self._host, *inputs.constants) for f in k.feeds),
        )
        if budget is not None:
            budget.check_slots(self.layout.device_bytes, num_slots)
        self.allocations = Allocations()
        self._metrics.gpu_slots.set(num_slots)
        self._ring: SlotRing[Slot] = SlotRing(
            self._make_slots(num_slots), self.allocations, self._metrics.gpu_slots_busy.set
        )
        self._pool = ThreadPoolExecutor(max_workers=num_slots, thread_name_prefix="gpu")
        self._watch = SlotWatch(
            self._cupy, self._ring, gpu.poll_interval_ms / 1000.0, gpu.batch_timeout_ms / 1000.0
        )
        self._runner = SlotRunner(self._pool, self._launcher, self._watch, self._metrics,
                                  self._nvjpeg)  # fmt: skip
        log.info(
            "gpu_stage_ready", device=gpu.device, slots=num_slots, rows=self.layout.max_batch_size,
            device_mib=round(self.layout.device_bytes * num_slots / 2**20, 1),
            pinned_mib=round(self.layout.pinned_bytes * num_slots / 2**20, 1),
            inputs={k.name: k.kind for k in inputs.kinds},
            device_image=image.name if image is not None else None, shapes=len(shapes.combos()),
            decode=gpu.decode, postprocess="host" if plan.host_postprocess else "gpu",
            device_columns=self.device_columnar,
        )  # fmt: skip

    def _make_slots(self, count: int) -> list[Slot]:
        slots: list[Slot] = []
        try:
            for index in range(count):
                slot = Slot.create(index, self.layout, self.allocations, self._cupy)
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

    async def dispatch(self, batch: Batch[Job]) -> asyncio.Future[Completed]:
        """A batch with a request to run takes a slot (waiting for one: the ring's
        bound is the stage's backpressure); one without is answered at once."""
        if self._watch.dead is not None:
            raise self._watch.dead
        loop = asyncio.get_running_loop()
        if not any(job.failure is None for job in batch.items):
            done: asyncio.Future[Completed] = loop.create_future()
            done.set_result(completed(batch, triage(batch, time.monotonic(), self._metrics)[0], 0))
            return done
        slot = await self._ring.acquire()
        fut = loop.create_task(self._run_batch(batch, slot), name=f"gpu-{batch.seq}")
        fut.add_done_callback(functools.partial(self._watch.batch_done, slot))
        return fut

    def close(self) -> None:
        """Stop accepting work, wait for in-flight streams and free every slot."""
        self._ring.close(self._watch.dead or EngineDead("GPU stage closed"))
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._watch.dead is None:
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

    # --- one batch ----------------------------------------------------------------

    async def _run_batch(self, batch: Batch[Job], slot: Slot) -> Completed:
        with structlog.contextvars.bound_contextvars(batch=batch.seq, slot=slot.index):
            rows, runnable = triage(batch, time.monotonic(), self._metrics)
            runnable = pinned(runnable, self._engine.info.version)
            on_device: dict[int, DeviceImage] = {}
            if runnable and needs_host_work(runnable, self._host, self._image):
                # Files for the host decoder are decoded and texts tokenized now, on
                # the stage's threads; JPEGs for nvJPEG keep their header's size
                # until their chunk runs.
                loop = asyncio.get_running_loop()
                runnable, on_device = await loop.run_in_executor(
                    self._pool, prepare_on_host, runnable, self._host, self._image,
                    self._nvjpeg is not None,
                )  # fmt: skip
            size = self._sizer(on_device)
            runnable = reject_oversized(runnable, size, self._max_input_bytes)
            engine_rows, service_s = 0, 0.0
            if runnable:
                started = time.monotonic()
                for group in self._inputs.groups(runnable, self._buckets):
                    lengths = self._inputs.bucketed(group, self._buckets)
                    for chunk in split_chunks(group, size, self._max_rows, self._max_input_bytes):
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
            answers, seconds = await self._runner.decode(slot, answers, on_device,
                                                         self._image.name)  # fmt: skip
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
        if self._watch.dead is not None:
            raise self._watch.dead
        device = on_device or {}
        run_lengths = (
            lengths if lengths is not None else self._inputs.bucketed(answers, self._buckets)
        )
        image = self._image
        chunks = split_chunks(answers, self._sizer(device), self._max_rows, self._max_input_bytes)
        results: list[tuple[list[Row], dict[str, np.ndarray], dict[str, int]]] = []
        for part in chunks:
            images = (
                [device.get(id(a)) or a.values[image.name] for a in part]
                if image is not None
                else []
            )
            outputs, timing = await self._runner.run_chunk(slot, Chunk(part, images, run_lengths))
            results.append((part, outputs, timing))
        # Filled only once every chunk succeeded: a failure leaves all untouched.
        for part, outputs, timing in results:
            self._scatter(part, outputs)
            for answer in part:
                answer.timing_us.update(timing)

    def _scatter(self, answers: list[Row], outputs: dict[str, np.ndarray]) -> None:
        """Each answer's rows: the device's postprocessed forms as they came back, or
        the host reference on the raw output; outputs cut back to each request's
        lengths (``OutputPlan``)."""
        with internal_errors_fail_the_run():
            if self._forms:
                forms = {name: outputs[name] for name in self._forms}
                self._outputs.scatter(outputs, answers, forms=forms)
            else:
                self._outputs.scatter(outputs, answers)

    async def run_device_columns(self, arrays: Mapping[str, Any],
                                 ready: Sequence[Any] = ()) -> dict[str, Any] | None:  # fmt: skip
        """A pipeline step's rows as whole-batch arrays (device or host, by request
        input, rows first) through the model on one slot, in runs of what it
        holds: its outputs as device arrays, a row a row (``columns``); None
        where the arrays are not what the model takes. ``ready``: events the
        inputs are complete at. Raises ``InferenceFailed`` or ``EngineDead``."""
        if self._watch.dead is not None:
            raise self._watch.dead
        limit = self._max_input_bytes or 0
        per_run = self._columns.rows_per_run(arrays, self._max_rows, limit)
        if not per_run:
            return None
        n = len(next(iter(arrays.values())))
        out: dict[str, Any] = {}
        slot = await self._ring.acquire()
        try:
            for start in range(0, n, per_run):
                chunk = ColumnChunk(arrays, start, min(n, start + per_run), out, ready)
                await self._runner.run(slot, chunk, self._columns.enqueue)
                self._metrics.batch_size.observe(chunk.stop - start)
        finally:
            self._watch.batch_done(slot)  # released once its stream is idle
        with internal_errors_fail_the_run():
            for name in self._outputs.passed:
                self._outputs.check(name, out[name], n)
        return out
