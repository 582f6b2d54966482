"""The thread side of the GPU stage: enqueue a chunk on a slot's stream, collect it.

Runs on the stage's worker threads, because collating rows into pinned staging
and a model's launch calls cost host time the event loop must not pay. All of a
chunk's GPU work is enqueued on its slot's stream in one go:

    collate host inputs (tensors, tokens, CPU-preprocessed images) into their
    pinned twins -> H2D each; pack the device image's pixels into pinned
    staging -> H2D (+ device copies of JPEGs nvJPEG decoded, ``nvjpeg``) ->
    preprocess kernel -> engine (at the chunk's lengths) -> softmax/top-k kernel
    -> D2H into pinned outputs -> event + host callback

so the host never waits between steps and chunks on different slots overlap.
Inputs and outputs are dense from the start of their buffers at the run's shape
(``worker.compute.engines.base.dense``): an output whose length follows a padded input
comes back at the chunk's length, not the longest.
Touches no asyncio object except through ``call_soon_threadsafe`` in the host
callback: the stage, on the loop, decides what a failure means.

Timings come from CUDA events on the slot's stream: ``preprocess`` = host
collation + H2D + packing + device copies + preprocess kernel (the stage adds
the nvJPEG decode, which runs before),
``infer`` = engine + postprocess kernels (the CPU stage also counts
postprocessing in ``infer``), ``d2h`` = the copies back.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import numpy as np

from worker.compute.engines.base import GpuEngine
from worker.compute.engines.cuda import buffer_address, translate_gpu_error
from worker.compute.gpu import kernels
from worker.compute.gpu.freeing import GATE
from worker.compute.gpu.nvjpeg import NvJpeg
from worker.compute.gpu.plan import PostprocessPlan
from worker.compute.gpu.slots import Slot, StagedImage, pack_batch
from worker.flow.errors import EngineDead, WorkerError
from worker.model.inputs import ModelInputs
from worker.model.inputs.base import BoundInput
from worker.model.inputs.image import BoundImage
from worker.model.rows import Row
from worker.model.shapes import dense

_H2D: Final = 1  # cudaMemcpyHostToDevice
_D2H: Final = 2  # cudaMemcpyDeviceToHost

Wake = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


def _wake(arg: Wake) -> None:
    """Runs on a CUDA driver thread when the stream reaches it: no CUDA calls here."""
    loop, fut = arg
    # The loop may have closed since the batch was submitted (shutdown): then
    # nobody awaits the future any more and there is nothing to wake.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_resolve, fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _ms_to_us(ms: float) -> int:
    return round(ms * 1e3)


class Chunk(NamedTuple):
    """One engine run on a slot: its answers, the device image's pixels for each
    (host arrays, or ``DeviceImage`` decoded by nvJPEG; empty without a device
    image), and the length of each padded dimension (one of the slot's buckets)."""

    answers: list[Row]
    images: list[StagedImage]
    lengths: dict[str, int]


class Launcher:
    """Enqueues chunks and collects their results for one GPU stage."""

    def __init__(
        self,
        cupy: Any,
        engine: GpuEngine,
        inputs: ModelInputs,
        device_image: BoundImage | None,
        host: Sequence[BoundInput],
        plan: PostprocessPlan,
        nvjpeg: NvJpeg | None = None,
    ) -> None:
        """``device_image``: the image input the kernels preprocess (or None);
        ``host``: the inputs collated on the host."""
        self._cupy = cupy
        self._engine = engine
        self._inputs = inputs
        self._image = device_image
        self._host = tuple(host)
        self._plan = plan
        self._nvjpeg = nvjpeg

    def warm_kernels(self, device: int) -> None:
        """Compile and load every kernel this stage will launch, now."""
        if self._image is not None:
            defines = kernels.preprocess_defines(self._image.cfg)
            kernels.load_module("preprocess.cu", defines, device, self._cupy)
        plan = self._plan
        if plan.topk or plan.gpu_softmax_rows:
            pp = plan.post
            defines = kernels.postprocess_defines(
                plan.raw.row_elements,
                plan.topk or 1,
                pp.softmax if plan.topk else True,
                str(plan.raw.dtype),
            )
            kernels.load_module("postprocess.cu", defines, device, self._cupy)

    def submit(
        self, slot: Slot, chunk: Any, wake: Wake,
        enqueue: Callable[[Slot, Any], float] | None = None,
    ) -> tuple[float, WorkerError | None]:  # fmt: skip
        """Enqueue the whole chunk on the slot's stream (by ``enqueue``: a
        pipeline's columns, ``worker.compute.gpu.columns``; default: a chunk of
        requests).

        Always ends by recording ``finished`` and enqueueing the wake-up, even
        after a failure part-way, so the caller can wait until the stream is idle
        before the slot is reused. Returns the host preprocessing seconds and the
        translated failure, if any; raises ``EngineDead`` when even that fails.
        """
        cp = self._cupy
        host_seconds = 0.0
        error: WorkerError | None = None
        # Shared with the other submissions; an eviction waits for it (``freeing``).
        with GATE.submitting(), cp.cuda.Device(slot.device):
            try:
                host_seconds = (enqueue or self._enqueue)(slot, chunk)
            except Exception as exc:  # boundary: CuPy / engine library errors
                error = translate_gpu_error(exc, f"slot {slot.index}")
            try:
                slot.events.finished.record(slot.stream)
                slot.stream.launch_host_func(_wake, wake)
            except Exception as exc:  # boundary: not even an event can be recorded
                dead = translate_gpu_error(exc, f"slot {slot.index}: completion")
                raise (dead if isinstance(dead, EngineDead) else EngineDead(str(dead))) from exc
        return host_seconds, error

    def _enqueue(self, slot: Slot, chunk: Chunk) -> float:
        stream = slot.stream
        n = len(chunk.answers)
        host_seconds = self._stage_host(slot, chunk)
        if self._image is not None:
            self._stage_packed(slot, chunk.images)
        slot.events.preprocessed.record(stream)
        shapes = self._engine.enqueue(slot, max(n, self._engine.min_batch_size), chunk.lengths)
        slot.run_shapes = {**self._plan.result_shapes, **shapes}
        self.postprocess_on_device(slot, n)
        slot.events.inferred.record(stream)
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        for name in self._plan.copy_back:
            dst = slot.host_results[name]
            src = slot.device_buffer(name)
            nbytes = n * math.prod(slot.run_shapes[name]) * dst.dtype.itemsize
            memcpy(dst.ctypes.data, buffer_address(src), nbytes, _D2H, stream.ptr)
        return host_seconds

    def _stage_host(self, slot: Slot, chunk: Chunk) -> float:
        """The host inputs collated (tensors stacked, tokens padded, CPU images
        preprocessed: the NumPy reference) into their pinned twins at the chunk's
        lengths, then copied in. The start event is recorded after the host work,
        on the idle stream: start..preprocessed is then the copies and the kernel,
        and the host seconds are not counted twice."""
        t0 = time.monotonic()
        collated = (
            self._inputs.collate(chunk.answers, chunk.lengths, slot.host_inputs, self._host).feeds
            if self._host or self._inputs.constants
            else {}
        )
        host_seconds = time.monotonic() - t0
        slot.events.start.record(slot.stream)
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        for name, view in collated.items():
            dst = slot.engine_inputs[name]
            memcpy(buffer_address(dst), view.ctypes.data, view.nbytes, _H2D, slot.stream.ptr)
        return host_seconds

    def _stage_packed(self, slot: Slot, images: list[StagedImage]) -> None:
        """The device image's raw uint8 pixels to the device, preprocessed there by
        the kernel into its engine input. Host images go through pinned staging;
        images nvJPEG decoded are copied there on the device, after the host ones
        (``pack_batch``)."""
        assert self._image is not None
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        stream = slot.stream
        n = len(images)
        packed, table = slot.host_packed, slot.host_table
        assert packed is not None and table is not None
        packing = pack_batch(images, packed, table)
        if packing.host_bytes:
            memcpy(buffer_address(slot.dev_packed), packed.ctypes.data, packing.host_bytes, _H2D,
                   stream.ptr)  # fmt: skip
        memcpy(buffer_address(slot.dev_table), table.ctypes.data, n * 3 * 8, _H2D, stream.ptr)
        if packing.on_device:
            if self._nvjpeg is None:
                raise ValueError("device images staged without an nvJPEG decoder")
            self._nvjpeg.place(slot, packing.on_device)
        kernels.preprocess_batch(
            slot.dev_packed, slot.dev_table, n, slot.engine_inputs[self._image.desc.name],
            cfg=self._image.cfg, stream=stream, device=slot.device, cupy=self._cupy,
        )  # fmt: skip

    def postprocess_on_device(self, slot: Slot, n: int) -> None:
        plan = self._plan
        raw = slot.engine_outputs[plan.raw.name]
        if plan.topk:
            kernels.softmax_topk(
                raw, n, slot.results["topk_indices"], slot.results["topk_scores"],
                top_k=plan.topk, softmax=bool(plan.post.softmax),
                stream=slot.stream, device=slot.device, cupy=self._cupy,
            )  # fmt: skip
        elif plan.gpu_softmax_rows:
            kernels.softmax_rows(raw, n, slot.results["probabilities"], stream=slot.stream,
                                 device=slot.device, cupy=self._cupy)  # fmt: skip

    def collect(
        self, slot: Slot, n: int, host_seconds: float
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Copy the chunk's rows out of pinned memory (the slot is reused after
        this), at each output's shape for this run, and read the phase times from
        the slot's events."""
        outputs = {
            name: dense(slot.host_results[name], n, slot.run_shapes[name]).copy()
            for name in self._plan.copy_back
        }
        ev = slot.events
        elapsed = self._cupy.cuda.get_elapsed_time
        with self._cupy.cuda.Device(slot.device):  # this worker thread's device may differ
            timing = {
                "preprocess": round(host_seconds * 1e6)
                + _ms_to_us(elapsed(ev.start, ev.preprocessed)),
                "infer": _ms_to_us(elapsed(ev.preprocessed, ev.inferred)),
                "d2h": _ms_to_us(elapsed(ev.inferred, ev.finished)),
            }
        return outputs, timing
