"""``op = "nms"``: non-maximum suppression, as a detector's boxes are thinned
before their regions are cropped. Inputs ``boxes`` (``[N, 4]``: x0, y0, x1, y1)
and ``scores`` (``[N]``); a box is dropped where its score is under
``score_threshold`` or where it overlaps a box of a higher score by an IoU over
``iou_threshold`` (greedy, highest score first, as ``torchvision.ops.nms``); at
most ``max_boxes`` kept (0: all). Outputs ``boxes`` float32 ``[kept, 4]``,
``scores`` float32 ``[kept]`` and ``indices`` int64 ``[kept]`` (into the
inputs), highest score first."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np

from worker.compute.ops import Desc, Op, Run, device, shown
from worker.compute.ops.device import Batched, DeviceOps
from worker.config.checks import check
from worker.config.pipelines import Spec, StepConfig


def nms(
    boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, score_threshold: float = 0.0,
    max_boxes: int = 0,
) -> dict[str, np.ndarray]:  # fmt: skip
    b = np.asarray(boxes, np.float32).reshape(-1, 4)
    s = np.asarray(scores, np.float32).reshape(-1)
    if len(b) != len(s):
        raise ValueError(f"{len(b)} boxes and {len(s)} scores: one score a box")
    order = np.argsort(-s, kind="stable")
    order = order[s[order] >= score_threshold]
    x0, y0, x1, y1 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    area = np.maximum(0.0, x1 - x0) * np.maximum(0.0, y1 - y0)
    kept: list[int] = []
    while order.size and (max_boxes == 0 or len(kept) < max_boxes):
        i, rest = int(order[0]), order[1:]
        kept.append(i)
        w = np.maximum(0.0, np.minimum(x1[i], x1[rest]) - np.maximum(x0[i], x0[rest]))
        h = np.maximum(0.0, np.minimum(y1[i], y1[rest]) - np.maximum(y0[i], y0[rest]))
        inter = w * h
        union = area[i] + area[rest] - inter
        iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[iou <= iou_threshold]
    index = np.asarray(kept, np.int64)
    return {"boxes": b[index], "scores": s[index], "indices": index}


def _check(where: str, step: StepConfig, inputs: Mapping[str, Desc | None]) -> dict[str, Spec]:
    check(0.0 <= step.iou_threshold <= 1.0, f"{where}.iou_threshold", "must be 0 to 1")
    check(step.max_boxes >= 0, f"{where}.max_boxes", "must be >= 0 (0: every box kept)")
    boxes, scores = inputs["boxes"], inputs["scores"]
    check(boxes is None or (len(boxes[1]) == 2 and (
        boxes[1][1] in (4, None) or isinstance(boxes[1][1], str))),
          f"{where}.inputs.boxes", f"{step.inputs['boxes']!r} is {shown(boxes)}: boxes are "
          "[N, 4]")  # fmt: skip
    check(scores is None or len(scores[1]) == 1, f"{where}.inputs.scores",
          f"{step.inputs['scores']!r} is {shown(scores)}: scores are [N]")  # fmt: skip
    return {"boxes": Spec("float32", ("kept", 4)), "scores": Spec("float32", ("kept",)),
            "indices": Spec("int64", ("kept",))}  # fmt: skip


def _bind(step: StepConfig) -> Run:
    return functools.partial(nms, iou_threshold=step.iou_threshold,
                             score_threshold=step.score_threshold, max_boxes=step.max_boxes)


def _device(step: StepConfig, ops: DeviceOps) -> Batched:
    return device.nms(ops, step.iou_threshold, step.score_threshold, step.max_boxes)


OP = Op("nms", ("boxes", "scores"), ("iou_threshold", "score_threshold", "max_boxes"), False,
        _check, _bind, _device)  # fmt: skip
