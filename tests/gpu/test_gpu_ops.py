"""The pipeline ops' kernels (kernels/ops.cu through ``worker.compute.gpu.ops``) on a
GPU, against the CPU ops.

Tolerances: crops exactly equal Pillow's (``crops.crop_boxes``): the kernel does
only integer arithmetic on host-computed Pillow coefficients, so 0 is the
contract, not an aim. NMS: the same indices in the same order as ``nms.nms`` (IoU
with each float32 operation rounded as NumPy rounds it). Resize: the preprocess
kernel's own contract (tests/gpu/test_gpu_kernels.py), float32 ``atol = 1e-5``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.models import image_pre
from tests.unit.compute.test_gpu_ops import random_boxes, random_detections
from worker.compute.gpu import ops
from worker.compute.ops.crops import crop_boxes
from worker.compute.ops.nms import nms
from worker.model.preprocess import preprocess

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", [(48, 320), (8, 8), (64, 17)])
def test_crops_of_several_images_equal_pillow(
    cp: Any, channels: int, size: tuple[int, int]
) -> None:
    rng = np.random.default_rng(size[0] + channels)
    shapes = [(37, 53), (1, 1), (480, 640), (200, 9), (3, 700), (1080, 1920)]
    images = [rng.integers(0, 256, (h, w, channels), dtype=np.uint8) for h, w in shapes]
    boxes = [random_boxes(rng, 8, h, w) for h, w in shapes]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        device_images = [cp.asarray(image) for image in images]
    got = ops.crop_boxes_device(cp, device_images, boxes, size, stream=stream)
    stream.synchronize()
    pairs = zip(images, boxes, strict=True)
    want = np.concatenate([crop_boxes(i, b, size)["crops"] for i, b in pairs])
    host = cp.asnumpy(got)
    diff = np.abs(host.astype(int) - want)
    assert diff.max() == 0, f"{np.count_nonzero(diff)} values differ, by up to {diff.max()}"


@pytest.mark.parametrize("n", [0, 1, 64, 65, 1000, 5000])
@pytest.mark.parametrize("ties", [False, True])
def test_nms_keeps_the_cpu_nms_indices(cp: Any, n: int, ties: bool) -> None:
    boxes, scores = random_detections(np.random.default_rng(n + ties), n, ties)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dev_boxes, dev_scores = cp.asarray(boxes), cp.asarray(scores)
    for iou, score_min, limit in [(0.5, 0.0, 0), (0.0, 0.0, 0), (0.3, 0.5, 0), (0.7, 0.2, 7)]:
        got = ops.nms_device(cp, dev_boxes, dev_scores, iou, score_min, limit, stream=stream)
        np.testing.assert_array_equal(got, nms(boxes, scores, iou, score_min, limit)["indices"])


def test_resize_equals_the_cpu_resize(cp: Any) -> None:
    cfg = image_pre(size=(224, 224), channels=3, mean=(0.485, 0.456, 0.406),
                    std=(0.229, 0.224, 0.225))  # fmt: skip
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(480, 640), (7, 9)]]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        device_images = [cp.asarray(image) for image in images]
    got = ops.resize_device(cp, device_images, cfg, stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(cp.asnumpy(got), preprocess(images, cfg), rtol=0, atol=1e-5)
