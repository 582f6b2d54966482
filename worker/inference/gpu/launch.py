"""The thread side of the GPU stage: enqueue a chunk on a slot's stream, collect it.

Runs on the stage's worker threads, because packing bytes into pinned staging
and a model's launch calls cost host time the event loop must not pay. All of a
chunk's GPU work is enqueued on its slot's stream in one go:

    pack images into pinned staging -> H2D (+ device copies of JPEGs nvJPEG
    decoded, ``nvjpeg``) -> preprocess kernel -> engine
    -> softmax/top-k kernel -> D2H into pinned outputs -> event + host callback

so the host never waits between steps and chunks on different slots overlap.
Touches no asyncio object except through ``call_soon_threadsafe`` in the host
callback: the stage, on the loop, decides what a failure means.

Timings come from CUDA events on the slot's stream: ``preprocess`` = packing
+ H2D + device copies + preprocess kernel (host preprocessing + H2D when it
runs on the CPU; the stage adds the nvJPEG decode, which runs before),
``infer`` = engine + postprocess kernels (the CPU stage also counts
postprocessing in ``infer``), ``d2h`` = the copies back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Final

import numpy as np

from worker.config import ModelConfig
from worker.engines.base import GpuEngine
from worker.engines.cuda import translate_gpu_error
from worker.errors import EngineDead, WorkerError
from worker.inference.gpu import kernels
from worker.inference.gpu.nvjpeg import NvJpeg
from worker.inference.gpu.plan import PostprocessPlan
from worker.inference.gpu.slots import Slot, StagedImage, pack_batch
from worker.inference.postprocess import postprocess
from worker.inference.preprocess import preprocess_into

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


class Launcher:
    """Enqueues chunks and collects their results for one GPU stage."""

    def __init__(
        self,
        cupy: Any,
        engine: GpuEngine,
        model: ModelConfig,
        plan: PostprocessPlan,
        nvjpeg: NvJpeg | None = None,
    ) -> None:
        self._cupy = cupy
        self._engine = engine
        self._model = model
        self._plan = plan
        self._nvjpeg = nvjpeg
        self._gpu_preprocess = model.preprocess.device == "gpu"

    def warm_kernels(self, device: int) -> None:
        """Compile and load every kernel this stage will launch, now."""
        if self._gpu_preprocess:
            kernels.load_module(
                "preprocess.cu", kernels.preprocess_defines(self._model.preprocess), device
            )
        plan = self._plan
        if plan.topk or plan.gpu_softmax_rows:
            pp = plan.post
            defines = kernels.postprocess_defines(
                plan.raw.row_elements,
                plan.topk or 1,
                pp.softmax if plan.topk else True,
                str(plan.raw.dtype),
            )
            kernels.load_module("postprocess.cu", defines, device)

    def submit(
        self, slot: Slot, images: list[StagedImage], wake: Wake
    ) -> tuple[float, WorkerError | None]:
        """Enqueue the whole chunk on the slot's stream.

        Always ends by recording ``finished`` and enqueueing the wake-up, even
        after a failure part-way, so the caller can wait until the stream is idle
        before the slot is reused. Returns the host preprocessing seconds and the
        translated failure, if any; raises ``EngineDead`` when even that fails.
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

    def _enqueue(self, slot: Slot, images: list[StagedImage]) -> float:
        stream = slot.stream
        n = len(images)
        if self._gpu_preprocess:
            host_seconds = self._stage_packed(slot, images)
        else:
            host_seconds = self._stage_preprocessed(slot, images)
        slot.events.preprocessed.record(stream)
        self._engine.enqueue(slot, max(n, self._engine.min_batch_size))
        self._postprocess_on_device(slot, n)
        slot.events.inferred.record(stream)
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        for name in self._plan.copy_back:
            dst = slot.host_results[name]
            src = slot.device_buffer(name)
            memcpy(dst.ctypes.data, src.data.ptr, slot.rows_nbytes(name, n), _D2H, stream.ptr)
        return host_seconds

    def _stage_packed(self, slot: Slot, images: list[StagedImage]) -> float:
        """Raw uint8 pixels to the device, preprocessed there by the kernel. Host
        images go through pinned staging; images nvJPEG decoded are copied there
        on the device, after the host ones (``pack_batch``)."""
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        stream = slot.stream
        n = len(images)
        slot.events.start.record(stream)  # packing into pinned staging counts as preprocess
        packed, table = slot.host_packed, slot.host_table
        assert packed is not None and table is not None
        packing = pack_batch(images, packed, table)
        if packing.host_bytes:
            memcpy(
                slot.dev_packed.data.ptr, packed.ctypes.data, packing.host_bytes, _H2D, stream.ptr
            )
        memcpy(slot.dev_table.data.ptr, table.ctypes.data, n * 3 * 8, _H2D, stream.ptr)
        if packing.on_device:
            if self._nvjpeg is None:
                raise ValueError("device images staged without an nvJPEG decoder")
            self._nvjpeg.place(slot, packing.on_device)
        kernels.preprocess_batch(
            slot.dev_packed, slot.dev_table, n, slot.engine_input,
            cfg=self._model.preprocess, stream=stream, device=slot.device,
        )  # fmt: skip
        return 0.0

    def _stage_preprocessed(self, slot: Slot, images: list[StagedImage]) -> float:
        """Preprocessed on the host (NumPy reference), then copied to the device."""
        host = slot.host_input
        assert host is not None
        t0 = time.monotonic()
        preprocess_into(images, self._model.preprocess, host)  # type: ignore[arg-type]
        host_seconds = time.monotonic() - t0
        # Recorded after the host work, on the idle stream: start..preprocessed is
        # then the H2D copy alone, and host_seconds is not counted twice.
        slot.events.start.record(slot.stream)
        nbytes = len(images) * self._engine.input.row_bytes
        self._cupy.cuda.runtime.memcpyAsync(
            slot.engine_input.data.ptr, host.ctypes.data, nbytes, _H2D, slot.stream.ptr
        )
        return host_seconds

    def _postprocess_on_device(self, slot: Slot, n: int) -> None:
        plan = self._plan
        raw = slot.engine_outputs[plan.raw.name]
        if plan.topk:
            kernels.softmax_topk(
                raw, n, slot.results["topk_indices"], slot.results["topk_scores"],
                top_k=plan.topk, softmax=bool(self._plan.post.softmax),
                stream=slot.stream, device=slot.device,
            )  # fmt: skip
        elif plan.gpu_softmax_rows:
            kernels.softmax_rows(
                raw, n, slot.results["probabilities"], stream=slot.stream, device=slot.device
            )

    def collect(
        self, slot: Slot, n: int, host_seconds: float
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Copy the chunk's rows out of pinned memory (the slot is reused after
        this) and read the phase times from the slot's events."""
        plan = self._plan
        outputs: dict[str, np.ndarray]
        if plan.host_postprocess:
            raw = slot.host_results[plan.raw.name][:n].copy()
            outputs = postprocess(raw, plan.post, plan.raw.name)
        else:
            outputs = {name: slot.host_results[name][:n].copy() for name in plan.copy_back}
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
