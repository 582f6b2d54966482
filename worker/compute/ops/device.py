"""A pipeline's built-in operations on the GPU, where the pipeline runs a model
there: each op step's rows (every chosen unit of the batch) in one go, by the
CuPy kernels of ``kernels/ops.cu`` and ``preprocess.cu``
(``worker.compute.gpu.ops``), equal to the NumPy operations they stand for
(bit for bit for crops; see tests/unit/compute/test_gpu_ops.py).

The inputs come from the host (an earlier step's outputs, the request's
pixels) and the outputs go back to it: a model step after an op copies its rows
to the device again. (Keeping intermediates on the device between GPU steps
needs the GPU stage to take device arrays: not built.) An op whose batch
cannot run on the device (a box with no pixel, an image of two or four
channels) raises, and its step runs the NumPy operation on each unit instead,
which names the request at fault.

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


def crops(ops: DeviceOps, size: tuple[int, int]) -> Batched:
    """``crop_boxes`` for every unit in one launch pair: each distinct image
    (a request's regions share its pixels) uploaded once."""
    from worker.compute.gpu.ops import crop_boxes_device

    def run(args: Sequence[Args]) -> list[dict[str, np.ndarray]]:
        images: list[np.ndarray] = []
        boxes: list[list[np.ndarray]] = []
        where: dict[int, int] = {}  # id(image) -> its index
        spans: list[tuple[int, int, int]] = []  # per unit: image, first box, boxes
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
        starts = np.concatenate([[0], np.cumsum([len(b) for b in per_image])])
        with ops.cupy.cuda.Device(ops.device):
            dev = [ops.upload(np.ascontiguousarray(i)) for i in images]
            out = crop_boxes_device(ops.cupy, dev, per_image, size, stream=ops.stream,
                                    device=ops.device)  # fmt: skip
        host = ops.download(out)
        return [{"crops": host[starts[k] + first : starts[k] + first + n],
                 "box": per_image[k][first : first + n].astype(np.float32)}
                for k, first, n in spans]  # fmt: skip

    return run


def resize(ops: DeviceOps, cfg: Any) -> Batched:
    """``resize`` for every unit in one launch (the model inputs' own kernel)."""
    from worker.compute.gpu.ops import resize_device

    def run(args: Sequence[Args]) -> list[dict[str, np.ndarray]]:
        images = [a["image"] for a in args]
        if any(i.dtype != np.uint8 or i.ndim not in (2, 3) for i in images):
            raise ValueError("not uint8 pixels: the NumPy operation says why, by request")
        with ops.cupy.cuda.Device(ops.device):
            dev = [ops.upload(np.ascontiguousarray(i)) for i in images]
            out = resize_device(ops.cupy, dev, cfg, stream=ops.stream, device=ops.device)
        host = ops.download(out)
        return [{"image": host[k]} for k in range(len(images))]

    return run


def nms(ops: DeviceOps, iou_threshold: float, score_threshold: float,
        max_boxes: int) -> Batched:  # fmt: skip
    """``nms`` for each unit (its boxes' mask on the device, the greedy walk on
    the host); the kept boxes and scores gathered as the NumPy operation does."""
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

    return run
