"""A pipeline's built-in operations on the GPU, where the pipeline runs a model
there: each op step's rows (every chosen unit of the batch) in one go, by the
CuPy kernels of ``kernels/ops.cu`` and ``preprocess.cu``
(``worker.compute.gpu.ops``), equal to the NumPy operations they stand for
(bit for bit for crops; see tests/unit/compute/test_gpu_ops.py).

Each op has two device forms (``DeviceOp``). ``host``: inputs from the host,
outputs back to it (a pipeline whose models run elsewhere, or an op beside host
steps). ``resident``: inputs as they are (device arrays where an earlier GPU
step left them, else host arrays, uploaded), the outputs a kernel makes left on
the device as one array a step (``Made``), for the GPU model step after it to
take device to device (``worker.compute.resident``); what it reads on the host
(crops' boxes: the weights are computed there; nms's walk) is named in
``host_reads`` and copied to the host first. An op whose batch cannot run on the
device (a box with no pixel, an image of two or four channels) raises, and its
step runs the NumPy operation on each unit instead, which names the request at
fault.

``DeviceOps.on`` takes the CuPy of the pipeline's GPU models (or, for
``gpu-twin``, its CPU twin: how this is tested without a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Args = Mapping[str, np.ndarray]
# An op on the device: every unit's inputs in, every unit's outputs out, in order;
# raises where the batch cannot run there.
Batched = Callable[[Sequence[Args]], list[dict[str, np.ndarray]]]


@dataclass(frozen=True)
class Made:
    """What an op's resident form made for a step's rows: per row its outputs on
    the host, and the outputs left on the device, one array each with a row for
    each unit after the step (a fan-out: each row's regions in turn, ``regions``
    of them a row), complete once ``ready`` (an event on the ops' stream) is."""

    host: list[dict[str, np.ndarray]]
    device: dict[str, Any]
    ready: Any = None
    regions: list[int] | None = None  # a fan-out's regions per row; None: one unit a row


# Every row's inputs (host or device arrays) -> what it made; raises as ``Batched``.
Resident = Callable[[Sequence[Mapping[str, Any]]], Made]


@dataclass(frozen=True)
class DeviceOp:
    """An op's two GPU forms (see the module doc); called, the host one (``Batched``)."""

    ops: DeviceOps
    host: Batched
    resident: Resident
    host_reads: tuple[str, ...] = ()  # inputs it reads on the host

    def __call__(self, args: Sequence[Args]) -> list[dict[str, np.ndarray]]:
        return self.host(args)


@dataclass(frozen=True)
class DeviceOps:
    """The device a pipeline's ops run on: its CuPy (or the twin), the device's
    index and a stream of the ops' own."""

    cupy: Any
    device: int
    stream: Any

    @classmethod
    def on(cls, backend: str, device: int) -> DeviceOps:
        from worker.compute.gpu.twin import cupy_for

        cupy = cupy_for(backend)
        with cupy.cuda.Device(device):
            return cls(cupy, device, cupy.cuda.Stream(non_blocking=True))

    def ready(self) -> Any:
        """An event after everything enqueued on the ops' stream so far: another
        stream waits for it before reading what they made (no host wait)."""
        with self.cupy.cuda.Device(self.device):
            event = self.cupy.cuda.Event()
            event.record(self.stream)
        return event

    def on_device(self, array: Any) -> Any:
        """``array`` on the device: as it is where it is there (C-contiguous),
        else uploaded."""
        from worker.compute.gpu.ops import is_device

        if is_device(self.cupy, array):
            with self.cupy.cuda.Device(self.device):
                return self.cupy.ascontiguousarray(array)
        return self.upload(np.ascontiguousarray(array))

    def upload(self, host: np.ndarray) -> Any:
        from worker.compute.gpu.ops import upload

        with self.cupy.cuda.Device(self.device):
            return upload(self.cupy, host, self.stream)

    def download(self, dev: Any) -> np.ndarray:
        """A device array on the host, once everything enqueued so far is done."""
        from worker.compute.gpu.ops import download

        host = np.empty(dev.shape, dev.dtype)
        with self.cupy.cuda.Device(self.device):
            download(self.cupy, dev, host, self.stream)
            self.stream.synchronize()
        return host


Spans = list[tuple[int, int, int]]  # per row: its image, its first box there, its boxes


def _crop_spans(args: Sequence[Mapping[str, Any]]) -> tuple[list[Any], list[np.ndarray], Spans]:
    """Each distinct image (a request's regions share its pixels) once, its
    boxes (host, float64) together, and per row: (image, first box, boxes)."""
    images: list[Any] = []
    boxes: list[list[np.ndarray]] = []
    where: dict[int, int] = {}  # id(image) -> its index
    spans: Spans = []
    for a in args:
        image = a["image"]
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError("not uint8 pixels: the NumPy operation says why, by request")
        k = where.setdefault(id(image), len(images))
        if k == len(images):
            images.append(image)
            boxes.append([])
        b = np.asarray(a["boxes"], np.float64).reshape(-1, 4)
        spans.append((k, sum(len(x) for x in boxes[k]), len(b)))
        boxes[k].append(b)
    per_image = [np.concatenate(b) if b else np.zeros((0, 4)) for b in boxes]
    return images, per_image, spans


def crops(ops: DeviceOps, size: tuple[int, int]) -> DeviceOp:
    """``crop_boxes`` for every unit in one launch pair, each distinct image on
    the device once; resident, the crops stay there in the rows' order."""
    from worker.compute.gpu.ops import crop_boxes_device

    def launch(args: Sequence[Mapping[str, Any]]) -> tuple[Any, list[np.ndarray], Spans, Any]:
        images, per_image, spans = _crop_spans(args)
        starts = np.concatenate([[0], np.cumsum([len(b) for b in per_image])]).astype(int)
        with ops.cupy.cuda.Device(ops.device):
            dev = [ops.on_device(i) for i in images]
            out = crop_boxes_device(ops.cupy, dev, per_image, size, stream=ops.stream,
                                    device=ops.device)  # fmt: skip
        return out, per_image, spans, starts

    def host(args: Sequence[Args]) -> list[dict[str, np.ndarray]]:
        out, per_image, spans, starts = launch(args)
        got = ops.download(out)
        return [{"crops": got[starts[k] + first : starts[k] + first + n],
                 "box": per_image[k][first : first + n].astype(np.float32)}
                for k, first, n in spans]  # fmt: skip

    def resident(args: Sequence[Mapping[str, Any]]) -> Made:
        out, per_image, spans, starts = launch(args)
        at = [int(starts[k] + first) for k, first, _ in spans]
        if any(a + s[2] != b for a, s, b in zip(at, spans, [*at[1:], len(out)], strict=True)):
            # Rows sharing an image in another order: gathered into the rows' order.
            with ops.cupy.cuda.Device(ops.device), ops.stream:
                out = ops.cupy.concatenate([out[a : a + s[2]] for a, s in zip(at, spans,
                                                                               strict=True)])
        boxes = [{"box": per_image[k][first : first + n].astype(np.float32)}
                 for k, first, n in spans]  # fmt: skip
        return Made(boxes, {"crops": out}, ops.ready(), [n for _, _, n in spans])

    return DeviceOp(ops, host, resident, host_reads=("boxes",))


def resize(ops: DeviceOps, cfg: Any) -> DeviceOp:
    """``resize`` for every unit in one launch (the model inputs' own kernel)."""
    from worker.compute.gpu.ops import resize_device

    def launch(args: Sequence[Mapping[str, Any]]) -> Any:
        images = [a["image"] for a in args]
        if any(i.dtype != np.uint8 or i.ndim not in (2, 3) for i in images):
            raise ValueError("not uint8 pixels: the NumPy operation says why, by request")
        with ops.cupy.cuda.Device(ops.device):
            dev = [ops.on_device(i) for i in images]
            return resize_device(ops.cupy, dev, cfg, stream=ops.stream, device=ops.device)

    def host(args: Sequence[Args]) -> list[dict[str, np.ndarray]]:
        got = ops.download(launch(args))
        return [{"image": got[k]} for k in range(len(args))]

    def resident(args: Sequence[Mapping[str, Any]]) -> Made:
        return Made([{} for _ in args], {"image": launch(args)}, ops.ready())

    return DeviceOp(ops, host, resident)


def nms(ops: DeviceOps, iou_threshold: float, score_threshold: float,
        max_boxes: int) -> DeviceOp:  # fmt: skip
    """``nms`` for each unit (its boxes' mask on the device, the greedy walk on
    the host); the kept boxes and scores gathered as the NumPy operation does.
    Its outputs are ragged (a unit's kept boxes) and its walk is on the host, so
    resident it reads its inputs on the host and answers there."""
    from worker.compute.gpu.ops import nms_device

    def run(args: Sequence[Args]) -> list[dict[str, np.ndarray]]:
        out: list[dict[str, np.ndarray]] = []
        for a in args:
            b = np.asarray(a["boxes"], np.float32).reshape(-1, 4)
            s = np.asarray(a["scores"], np.float32).reshape(-1)
            if len(b) != len(s):
                raise ValueError("boxes and scores differ in number")
            with ops.cupy.cuda.Device(ops.device):
                index = nms_device(ops.cupy, ops.upload(b), ops.upload(s), iou_threshold,
                                   score_threshold, max_boxes, stream=ops.stream,
                                   device=ops.device).astype(np.int64)  # fmt: skip
            out.append({"boxes": b[index], "scores": s[index], "indices": index})
        return out

    def resident(args: Sequence[Mapping[str, Any]]) -> Made:
        return Made(run(args), {})

    return DeviceOp(ops, run, resident, host_reads=("boxes", "scores"))
