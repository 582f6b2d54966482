"""The pipeline ops' GPU launch wrappers (``worker.compute.gpu.ops``) on the CPU twin,
whose kernels are kernels/ops.cu's NumPy references: crops equal Pillow's (the CPU
op ``crop_boxes``) exactly, NMS keeps the CPU ``nms``'s indices in its order, and
resize equals the CPU ``resize``. The CUDA source itself is run on the CPU in
test_kernels_compile.py and on a GPU in tests/gpu/test_gpu_ops.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.models import image_pre
from worker.compute.gpu import ops, twin
from worker.compute.gpu.resample import bilinear_coefficients, crop_plan
from worker.compute.ops.crops import crop_boxes
from worker.compute.ops.nms import nms
from worker.model.preprocess import preprocess


@pytest.fixture
def cp() -> Any:
    return twin.make()


def random_boxes(rng: np.random.Generator, n: int, height: int, width: int) -> np.ndarray:
    """Boxes of every kind: inside, past every edge, tiny, whole-image, fractional."""
    x0 = rng.uniform(-0.3 * width, 0.9 * width, n)
    y0 = rng.uniform(-0.3 * height, 0.9 * height, n)
    w = rng.uniform(0.5, 1.5 * width, n)
    h = rng.uniform(0.5, 1.5 * height, n)
    boxes = np.stack([x0, y0, x0 + w, y0 + h], axis=1)
    # Clipped to the image at least a pixel wide: the op refuses empty boxes.
    boxes[:, 0] = np.minimum(boxes[:, 0], width - 1)
    boxes[:, 1] = np.minimum(boxes[:, 1], height - 1)
    boxes[:, 2] = np.maximum(boxes[:, 2], np.maximum(boxes[:, 0], 0) + 1)
    boxes[:, 3] = np.maximum(boxes[:, 3], np.maximum(boxes[:, 1], 0) + 1)
    boxes[0] = (0, 0, width, height)
    boxes[1] = (-10, -10, width + 10, height + 10)
    return boxes.astype(np.float32)


# Crop sizes against image sizes: down- and upscaling, identity, one pixel,
# extreme aspect ratios, large downscale factors (wide antialiasing filters).
SIZES = [(8, 8), (48, 320), (1, 1), (17, 3), (64, 64), (5, 200)]


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", SIZES)
def test_crops_of_several_images_in_one_launch_equal_pillow(
    cp: Any, channels: int, size: tuple[int, int]
) -> None:
    rng = np.random.default_rng(hash((channels, size)) % 2**32)
    shapes = [(37, 53), (1, 1), (200, 9), (480, 640), (64, 64), (3, 700)]
    images = [rng.integers(0, 256, (h, w, channels), dtype=np.uint8) for h, w in shapes]
    boxes = [random_boxes(rng, 6, h, w) for h, w in shapes]
    stream = cp.cuda.Stream()
    got = cp.asnumpy(ops.crop_boxes_device(cp, images, boxes, size, stream=stream))
    want = np.concatenate(
        [crop_boxes(img, b, size)["crops"] for img, b in zip(images, boxes, strict=True)]
    )
    assert got.shape == want.shape and got.dtype == np.uint8
    diff = np.abs(got.astype(int) - want)
    assert diff.max() == 0, f"{np.count_nonzero(diff)} values differ, by up to {diff.max()}"


def test_grey_images_without_a_channel_axis_and_no_boxes(cp: Any) -> None:
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (30, 20), dtype=np.uint8)
    boxes = np.array([[2.5, 3.2, 17.9, 28.1]], np.float32)
    stream = cp.cuda.Stream()
    got = ops.crop_boxes_device(cp, [image], [boxes], (7, 11), stream=stream)
    np.testing.assert_array_equal(got, crop_boxes(image, boxes, (7, 11))["crops"])
    none = ops.crop_boxes_device(cp, [image], [np.zeros((0, 4))], (7, 11), stream=stream)
    assert none.shape == (0, 7, 11, 1)


def test_a_box_without_pixels_or_an_alpha_channel_is_refused(cp: Any) -> None:
    stream = cp.cuda.Stream()
    image = np.zeros((10, 10, 3), np.uint8)
    with pytest.raises(ValueError, match=r"image 1, box 1 \(20, 0, 30, 5\) holds no pixel"):
        ops.crop_boxes_device(cp, [image, image], [np.zeros((0, 4)), np.array(
            [[0, 0, 5, 5], [20, 0, 30, 5]])], (4, 4), stream=stream)  # fmt: skip
    with pytest.raises(ValueError, match="1 or 3 channels, not 4"):
        ops.crop_boxes_device(cp, [np.zeros((4, 4, 4), np.uint8)], [np.array([[0, 0, 2, 2]])],
                              (2, 2), stream=stream)  # fmt: skip
    with pytest.raises(ValueError, match="image 1 has 1 channels"):
        ops.pack_images(cp, [image, image[:, :, 0].copy()], stream=stream)


def test_coefficients_are_pillows_fixed_point_weights() -> None:
    """Runs sum to one in fixed point (within a unit a tap); upscaling reads two
    pixels, downscaling by k reads about 2k (the support scaled: antialiasing)."""
    bounds, coefs = bilinear_coefficients(np.array([4, 40, 400]), 10)
    total = coefs.sum(axis=-1)
    assert np.all(np.abs(total - (1 << 22)) <= coefs.shape[-1])
    assert bounds[0, :, 1].max() <= 2
    assert 7 <= bounds[2, 5, 1] <= 81 and coefs.shape[-1] == 81
    same, identity = bilinear_coefficients(np.array([10]), 10)
    np.testing.assert_array_equal(same[0, :, 0], np.arange(10))
    assert np.all(identity[0, :, 0] == 1 << 22) and np.all(identity[0, :, 1:] == 0)


# --- nms -----------------------------------------------------------------------------


def random_detections(rng: np.random.Generator, n: int, ties: bool) -> tuple[np.ndarray, ...]:
    centers = rng.uniform(0, 100, (n, 2))
    sizes = rng.uniform(1, 40, (n, 2))
    boxes = np.concatenate([centers - sizes / 2, centers + sizes / 2], axis=1)
    if n > 4:
        boxes[1] = boxes[0]  # duplicates: IoU exactly 1
        boxes[2] = (5, 5, 5, 9)  # degenerate: no area
        boxes[3, 2:] = boxes[3, :2] - 1  # inverted
    scores = rng.uniform(0, 1, n)
    if ties:
        scores = np.round(scores * 4) / 4  # many equal scores: order by index
    return boxes.astype(np.float32), scores.astype(np.float32)


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 130, 700])
@pytest.mark.parametrize("ties", [False, True])
def test_nms_keeps_the_cpu_nms_indices_in_its_order(cp: Any, n: int, ties: bool) -> None:
    rng = np.random.default_rng(n * 2 + ties)
    boxes, scores = random_detections(rng, n, ties)
    stream = cp.cuda.Stream()
    for iou, score_min, limit in [(0.5, 0.0, 0), (0.0, 0.0, 0), (1.0, 0.0, 0), (0.3, 0.5, 0),
                                  (0.7, 0.25, 5), (0.45, 0.0, 1)]:  # fmt: skip
        got = ops.nms_device(cp, boxes, scores, iou, score_min, limit, stream=stream)
        want = nms(boxes, scores, iou, score_min, limit)["indices"]
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want, err_msg=f"iou {iou} score {score_min} {limit}")


def test_nms_decides_threshold_ties_and_nan_as_the_cpu_nms(cp: Any) -> None:
    """IoU exactly at the threshold is kept (<=), as float32 compares it; a NaN box
    suppresses and is suppressed as NumPy's NaN comparisons decide."""
    boxes = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [0, 0, 10, 10], [np.nan, 0, 4, 4],
                      [20, 20, 30, 30]], np.float32)  # fmt: skip
    scores = np.array([0.9, 0.8, 0.7, 0.95, 0.6], np.float32)
    stream = cp.cuda.Stream()
    for iou in (1 / 3, 0.3, 0.34, 1.0):
        got = ops.nms_device(cp, boxes, scores, iou, stream=stream)
        np.testing.assert_array_equal(got, nms(boxes, scores, iou)["indices"])


def test_nms_refuses_what_it_cannot_answer(cp: Any) -> None:
    stream = cp.cuda.Stream()
    with pytest.raises(ValueError, match="float32"):
        ops.nms_device(cp, np.zeros((2, 4)), np.zeros(2, np.float32), 0.5, stream=stream)
    with pytest.raises(ValueError, match=r"boxes \[N, 4\]"):
        ops.nms_device(cp, np.zeros((2, 4), np.float32), np.zeros(3, np.float32), 0.5,
                       stream=stream)  # fmt: skip


# --- resize --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_resize_is_the_preprocess_kernel(cp: Any, layout: str) -> None:
    cfg = image_pre(size=(24, 16), channels=3, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4),
                    layout=layout)  # fmt: skip
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(7, 90), (50, 50)]]
    got = ops.resize_device(cp, images, cfg, stream=cp.cuda.Stream())
    np.testing.assert_array_equal(got, preprocess(images, cfg))


@pytest.mark.parametrize("rule", [False, True])
def test_either_pass_order_is_pillows_for_that_order(cp: Any, rule: bool) -> None:
    """Pillow before 13 always resized horizontally first; 13 goes vertical first
    where the height shrinks more than twice the width. Each order, forced, equals
    Pillow's two one-axis resizes in that order (each exact on its own)."""
    rng = np.random.default_rng(9)
    image = rng.integers(0, 256, (300, 40, 3), dtype=np.uint8)  # 300 -> 20 rows: vertical first
    size = (20, 30)
    plan = crop_plan([(300, 40)], [0], [np.array([[0, 0, 40, 300]])], size, 3, rule)
    got = ops.launch_crops(cp, image.reshape(-1), plan, stream=cp.cuda.Stream())[0]
    bilinear = Image.Resampling.BILINEAR
    pil = Image.fromarray(image)
    if rule:
        want = pil.resize((40, 20), bilinear).resize((30, 20), bilinear)
    else:
        want = pil.resize((30, 300), bilinear).resize((30, 20), bilinear)
    np.testing.assert_array_equal(got, np.asarray(want))
