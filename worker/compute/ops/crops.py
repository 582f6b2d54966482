"""``op = "crop_boxes"``: a pipeline's built-in step between a detector and a
recogniser: an image's regions, given boxes, cropped and resized to one size, one
per box (a fan-out: the steps after it run once per crop). Inputs ``image``
(uint8 pixels ``[H, W, C]`` or ``[H, W]``) and ``boxes`` (``[N, 4]``: x0, y0,
x1, y1 in pixels); ``size = [height, width]``; outputs ``crops``, uint8
``[height, width, C]`` a box, and ``box``, float32 ``[4]``, the box it was cut
from (as given: the steps after it know where their region is)."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
from PIL import Image

from worker.compute.ops import Desc, Op, Run, device, shown
from worker.compute.ops.device import Batched, DeviceOps
from worker.config.checks import check
from worker.config.pipelines import Spec, StepConfig

OUTPUT = "crops"
BOX = "box"


def crop_boxes(
    image: np.ndarray, boxes: np.ndarray, size: tuple[int, int]
) -> dict[str, np.ndarray]:
    """Each box of ``image`` (uint8 ``[H, W, C]`` or ``[H, W]``; a box is ``x0, y0,
    x1, y1`` in pixels, clipped to the image) resized bilinearly to ``size``
    (height, width) as Pillow resizes: uint8 ``[N, height, width, C]``, N boxes.
    A box with nothing inside the image is refused, naming it."""
    if image.dtype != np.uint8 or image.ndim not in (2, 3):
        raise ValueError(f"image: expected uint8 [H, W, C], got {image.dtype} {list(image.shape)}")
    pixels = image if image.ndim == 3 else image[:, :, None]
    rows, cols, channels = pixels.shape
    flat = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    height, width = size
    out = np.empty((len(flat), height, width, channels), np.uint8)
    for k, (x0, y0, x1, y1) in enumerate(flat):
        left, top = max(0, int(np.floor(x0))), max(0, int(np.floor(y0)))
        right, bottom = min(cols, int(np.ceil(x1))), min(rows, int(np.ceil(y1)))
        if right <= left or bottom <= top:
            raise ValueError(f"box {k} ({x0:g}, {y0:g}, {x1:g}, {y1:g}) holds no pixel of the "
                             f"{cols}x{rows} image")  # fmt: skip
        crop = pixels[top:bottom, left:right]
        resized = Image.fromarray(crop[:, :, 0] if channels == 1 else crop).resize(
            (width, height), Image.Resampling.BILINEAR
        )
        out[k] = np.asarray(resized).reshape(height, width, channels)
    return {OUTPUT: out, BOX: flat.astype(np.float32)}


def _check(where: str, step: StepConfig, inputs: Mapping[str, Desc | None]) -> dict[str, Spec]:
    check(len(step.size) == 2 and all(n > 0 for n in step.size), f"{where}.size",
          f"{list(step.size)}: the crops' height and width, as [48, 320]")  # fmt: skip
    image, boxes = inputs["image"], inputs["boxes"]
    check(image is None or (image[0] == "uint8" and len(image[1]) in (2, 3)),
          f"{where}.inputs.image", f"{step.inputs['image']!r} is {shown(image)}: crop_boxes "
          "takes uint8 pixels [H, W, C]")  # fmt: skip
    check(boxes is None or (len(boxes[1]) == 2 and (
        boxes[1][1] in (4, None) or isinstance(boxes[1][1], str))), f"{where}.inputs.boxes",
          f"{step.inputs['boxes']!r} is {shown(boxes)}: boxes are [N, 4]")  # fmt: skip
    height, width = step.size
    return {OUTPUT: Spec("uint8", (height, width, "C")), BOX: Spec("float32", (4,))}


def _bind(step: StepConfig) -> Run:
    height, width = step.size
    return functools.partial(crop_boxes, size=(height, width))


def _device(step: StepConfig, ops: DeviceOps) -> Batched:
    height, width = step.size
    return device.crops(ops, (height, width))


OP = Op("crop_boxes", ("image", "boxes"), ("size",), True, _check, _bind, _device)
