"""The GPU stage's columns: a pipeline step's rows as whole-batch arrays, in
and out on the device (``GpuStage.run_device_columns``).

Where a pipeline runs GPU steps one after another, what one step made stays in
device memory for the next (``worker.compute.resident``). A model step then
takes its inputs as they are: a device array is copied device to device into
the slot's input buffer (an image's pixels into the slot's packed staging, for
the preprocessing kernel), a host array through the slot's pinned twin as any
batch's are; the engine and the postprocessing kernels run on the slot's stream
as for a batch of requests; and the outputs are copied, still on that stream,
out of the slot's buffers into arrays of their own (the slot is reused by the
next batch), which stay on the device. A step reading them on the host downloads
them there, once.

A model runs so (``columnar_on_device``) where each row is the array it is
given: stateless, any batch size, every input a tensor of fixed shape or the
image the kernels preprocess, no constant, nothing cut back to a request's
length, no output batched on another axis, and its postprocessing (if any) on
the device.

Ordering: inputs made on another stream (the ops') carry an event the slot's
stream waits for; the outputs are complete once the slot's stream is idle,
which the stage awaits before releasing the slot. On the CPU twin every stream
runs at once: the twin checks the copies, the order of the calls and the
answers, not that CUDA streams order them (tests/gpu does, on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from worker.compute.engines.base import GpuEngine
from worker.compute.engines.cuda import buffer_address
from worker.compute.gpu import kernels
from worker.compute.gpu.launch import Launcher
from worker.compute.gpu.ops import TRANSFERS, is_device
from worker.compute.gpu.plan import PostprocessPlan
from worker.compute.gpu.slots import Slot
from worker.flow.errors import InferenceFailed
from worker.model.inputs import ModelInputs
from worker.model.inputs.image import BoundImage
from worker.model.inputs.tensor import BoundTensor
from worker.model.outputs import OutputPlan

_H2D: Final = 1  # cudaMemcpyHostToDevice
_D2D: Final = 3  # cudaMemcpyDeviceToDevice


def columnar_on_device(inputs: ModelInputs, outputs: OutputPlan, plan: PostprocessPlan,
                       image: BoundImage | None) -> bool:  # fmt: skip
    """Whether a pipeline may run the model on whole-batch device arrays (see
    the module doc): decided once, when the stage is built."""
    kinds_fit = all((isinstance(k, BoundTensor) and k.desc.fixed) or k is image
                    for k in inputs.kinds)  # fmt: skip
    host_post = (outputs.active and plan.host_postprocess) or (
        not outputs.active and outputs.post.normalize)  # the reference on the host
    return (kinds_fit and not inputs.states and inputs.batch is None and not inputs.constants
            and not outputs.cuts and not outputs.axes and not host_post)  # fmt: skip


@dataclass(frozen=True)
class ColumnChunk:
    """Rows ``start:stop`` of a step's columns, run on one slot: ``arrays`` by
    request input (device or host, rows first), ``out`` the step's output
    arrays (allocated by the first chunk, each filled at its rows), ``ready``
    the events the inputs are complete at."""

    arrays: Mapping[str, Any]
    start: int
    stop: int
    out: dict[str, Any]
    ready: Sequence[Any] = ()


class Columns:
    """A GPU stage's columns path (thread side: enqueued on a slot's stream)."""

    def __init__(self, cupy: Any, engine: GpuEngine, inputs: ModelInputs,
                 image: BoundImage | None, plan: PostprocessPlan, outputs: OutputPlan,
                 launcher: Launcher) -> None:  # fmt: skip
        self._cupy = cupy
        self._engine = engine
        self._tensors = tuple(k for k in inputs.kinds if isinstance(k, BoundTensor))
        self._image = image
        self._plan = plan
        self._launcher = launcher
        # What the step answers with: as a request's answer carries them (the
        # outputs passed as they are, and the device's postprocessed forms).
        self.names = tuple(dict.fromkeys((*outputs.passed, *plan.forms)))

    def rows_per_run(self, arrays: Mapping[str, Any], max_rows: int, max_bytes: int) -> int:
        """How many rows one run takes: the slot's rows, and as many images as
        its packed staging holds; 0 where ``arrays`` are not what the model takes
        (a row of another dtype or shape, an image of other channels)."""
        n = {len(a) for a in arrays.values()}
        if len(n) != 1 or not n.pop():
            return 0
        for kind in self._tensors:
            a = arrays.get(kind.name)
            if a is None or a.dtype != kind.desc.dtype or tuple(a.shape[1:]) != kind.desc.shape:
                return 0
        if self._image is None:
            return max_rows
        a = arrays.get(self._image.name)
        channels = self._image.cfg.channels
        if a is None or a.dtype != np.uint8 or not (
            (a.ndim == 4 and a.shape[3] == channels) or (a.ndim == 3 and channels == 1)
        ):
            return 0
        row_bytes = math.prod(a.shape[1:])
        return min(max_rows, max_bytes // row_bytes) if row_bytes else 0

    def enqueue(self, slot: Slot, chunk: ColumnChunk) -> float:
        """The chunk's whole run on the slot's stream (``Launcher.submit`` records
        its end and wakes the stage): inputs in, engine, postprocessing kernels,
        outputs copied out of the slot into the step's arrays. Returns the host
        seconds spent (none worth counting: copies only)."""
        stream = slot.stream
        m = chunk.stop - chunk.start
        for event in chunk.ready:  # made on another stream: wait for it there
            stream.wait_event(event)
        slot.events.start.record(stream)
        for kind in self._tensors:
            self._copy_in(slot, chunk.arrays[kind.name][chunk.start : chunk.stop],
                          slot.engine_inputs[kind.desc.name], slot.host_inputs[kind.desc.name])
        if self._image is not None:
            self._stage_pixels(slot, chunk.arrays[self._image.name][chunk.start : chunk.stop])
        slot.events.preprocessed.record(stream)
        shapes = self._engine.enqueue(slot, max(m, self._engine.min_batch_size), {})
        slot.run_shapes = {**self._plan.result_shapes, **shapes}
        self._launcher.postprocess_on_device(slot, m)
        slot.events.inferred.record(stream)
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        for name in self.names:
            row = tuple(slot.run_shapes[name])
            src = slot.device_buffer(name)
            out = chunk.out.get(name)
            if out is None:
                n = len(next(iter(chunk.arrays.values())))
                with stream:  # freed on the stream it was made on (CuPy's pool)
                    out = chunk.out[name] = self._cupy.empty((n, *row), src.dtype)
            elif tuple(out.shape[1:]) != row:
                raise InferenceFailed(f"output {name!r}: rows of {list(row)} in one run, "
                                      f"{list(out.shape[1:])} in another")  # fmt: skip
            row_bytes = math.prod(row) * out.dtype.itemsize
            memcpy(buffer_address(out) + chunk.start * row_bytes, buffer_address(src),
                   m * row_bytes, _D2D, stream.ptr)  # fmt: skip
        return 0.0

    def _copy_in(self, slot: Slot, rows: Any, dst: Any, pinned: np.ndarray) -> None:
        """One input's rows into the slot's buffer, dense from its start: device
        to device where they are on the device, else through its pinned twin."""
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        if is_device(self._cupy, rows):
            rows = self._cupy.ascontiguousarray(rows)
            TRANSFERS.count("device_copies")
            memcpy(buffer_address(dst), buffer_address(rows), rows.nbytes, _D2D, slot.stream.ptr)
            return
        staged = pinned[: len(rows)]
        np.copyto(staged, rows)
        TRANSFERS.count("uploads")
        memcpy(buffer_address(dst), staged.ctypes.data, staged.nbytes, _H2D, slot.stream.ptr)

    def _stage_pixels(self, slot: Slot, pixels: Any) -> None:
        """A column of images of one size ([m, H, W, C] uint8) into the slot's
        packed staging (device to device where they are on the device), one
        table row each, and the preprocessing kernel into the engine input."""
        assert self._image is not None
        table, packed = slot.host_table, slot.host_packed
        assert table is not None and packed is not None
        m = len(pixels)
        size = math.prod(pixels.shape[1:])
        table[:m, 0] = np.arange(m) * size
        table[:m, 1], table[:m, 2] = pixels.shape[1], pixels.shape[2]
        self._copy_in(slot, pixels.reshape(m, -1), slot.dev_packed,
                      packed[: m * size].reshape(m, size))  # fmt: skip
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        memcpy(buffer_address(slot.dev_table), table.ctypes.data, m * 3 * 8, _H2D,
               slot.stream.ptr)  # fmt: skip
        kernels.preprocess_batch(
            slot.dev_packed, slot.dev_table, m, slot.engine_inputs[self._image.desc.name],
            cfg=self._image.cfg, stream=slot.stream, device=slot.device, cupy=self._cupy,
        )  # fmt: skip
