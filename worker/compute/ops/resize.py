"""``op = "resize"``: an image resized and normalised exactly as a model's image
input is (the worker's NumPy reference, ``worker.model.preprocess``), as a step
of its own: the preprocessing a detector's or classifier's file does not do,
before it or between two models. Input ``image`` (uint8 pixels ``[H, W, C]`` or
``[H, W]``); ``preprocess = {...}`` takes ``[model.preprocess]``'s keys, ``size``
and ``channels`` required (no model input declares them here); output
``image``, one row of the model input it makes: ``[C, height, width]`` (NCHW,
the default) or ``[height, width, C]``, float32 unless ``dtype`` says float16."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from worker.compute.ops import Desc, Op, Run, device, shown
from worker.compute.ops.device import Batched, DeviceOps
from worker.config.checks import check
from worker.config.pipelines import Spec, StepConfig
from worker.model.inputs.image import resolve_declared
from worker.model.preprocess import ImagePreprocess, preprocess

OUTPUT = "image"


def resolved(where: str, step: StepConfig) -> ImagePreprocess:
    check(step.preprocess is not None, f"{where}.preprocess", "resize takes the image's "
          "preprocessing, as { size = [224, 224], channels = 3, mean = [...], std = [...] }")
    assert step.preprocess is not None
    return resolve_declared(step.preprocess, "a resize step names the image it makes",
                            f"{where}.preprocess")  # fmt: skip


def _check(where: str, step: StepConfig, inputs: Mapping[str, Desc | None]) -> dict[str, Spec]:
    cfg = resolved(where, step)
    image = inputs["image"]
    check(image is None or (image[0] == "uint8" and len(image[1]) in (2, 3)),
          f"{where}.inputs.image", f"{step.inputs['image']!r} is {shown(image)}: resize takes "
          "uint8 pixels [H, W, C]")  # fmt: skip
    return {OUTPUT: Spec(cfg.dtype, cfg.batch_shape(1)[1:])}


def _bind(step: StepConfig) -> Run:
    cfg = resolved("resize", step)

    def resize(image: np.ndarray) -> dict[str, np.ndarray]:
        return {OUTPUT: preprocess([image], cfg)[0]}

    return resize


def _device(step: StepConfig, ops: DeviceOps) -> Batched:
    return device.resize(ops, resolved("resize", step))


OP = Op("resize", ("image",), ("preprocess",), False, _check, _bind, _device)
