"""The built-in operations (``worker.compute.ops``) against reference libraries:
``resize`` against Pillow's bilinear resize and the normalisation written out,
``nms`` against ``torchvision.ops.nms``; and the registry: one entry per op."""

from __future__ import annotations

import numpy as np
import pytest

from worker.compute.ops import OP_KEYS, op_named
from worker.compute.ops.nms import nms
from worker.config.pipelines import StepConfig, StepPreprocess
from worker.flow.errors import ConfigError


def test_the_registry_names_each_op_and_refuses_others() -> None:
    for name in ("crop_boxes", "resize", "nms"):
        op = op_named(name, "here")
        assert op.name == name and set(op.keys) <= set(OP_KEYS)
    with pytest.raises(ConfigError, match=r"here: 'rotate' is not a built-in operation "
                                          r"\(crop_boxes, nms, resize\)"):
        op_named("rotate", "here")


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_resize_is_torch_s_bilinear_then_the_normalisation(layout: str) -> None:
    """The worker's image resize is bilinear with half-pixel centres and no
    antialiasing (as OpenCV's INTER_LINEAR and torch's interpolate): what a
    model's own image input does, so ``resize`` before a model answers as the
    image sent to it would."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (37, 53, 3)).astype(np.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    step = StepConfig(name="r", op="resize", inputs={"image": "request.image"},
                      preprocess=StepPreprocess(size=(24, 32), channels=3, mean=mean, std=std,
                                                layout=layout))  # type: ignore[arg-type]
    got = op_named("resize", "r").bind(step)(image)["image"]
    chw = torch.from_numpy(image.astype(np.float32).transpose(2, 0, 1))[None]
    resized = torch.nn.functional.interpolate(chw, size=(24, 32), mode="bilinear",
                                              align_corners=False, antialias=False)[0]
    mean_c, std_c = np.float32(mean)[:, None, None], np.float32(std)[:, None, None]
    norm = (resized.numpy() / 255.0 - mean_c) / std_c
    want = norm if layout == "NCHW" else norm.transpose(1, 2, 0)
    assert got.dtype == np.float32 and got.shape == want.shape
    # Stated tolerance: float32 rounding, well under one uint8 level (1/255/std).
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_resize_step_needs_the_size_and_channels_it_makes() -> None:
    step = StepConfig(name="r", op="resize", inputs={"image": "request.image"},
                      preprocess=StepPreprocess(size=(24, 32)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"here\.preprocess\.channels: a resize step names"):
        op_named("resize", "here").check("here", step, {"image": ("uint8", ("H", "W", 3))})


def test_nms_keeps_what_torchvision_keeps() -> None:
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    rng = np.random.default_rng(7)
    for trial in range(20):
        n = int(rng.integers(0, 60))
        xy = rng.uniform(0, 100, (n, 2)).astype(np.float32)
        wh = rng.uniform(1, 40, (n, 2)).astype(np.float32)
        boxes = np.concatenate([xy, xy + wh], axis=1)
        scores = rng.permutation(n).astype(np.float32) / max(n, 1)  # distinct: no ties
        iou = float(rng.uniform(0.1, 0.9))
        want = ops.nms(torch.from_numpy(boxes), torch.from_numpy(scores), iou).numpy()
        got = nms(boxes, scores, iou)
        np.testing.assert_array_equal(got["indices"], want, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(got["boxes"], boxes[want])
        np.testing.assert_array_equal(got["scores"], scores[want])


def test_nms_thresholds_scores_and_caps_the_boxes() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60], [80, 80, 90, 90]],
                     np.float32)  # fmt: skip
    scores = np.array([0.9, 0.8, 0.3, 0.05], np.float32)
    got = nms(boxes, scores, 0.5, score_threshold=0.1)
    assert got["indices"].tolist() == [0, 2]  # 1 overlaps 0; 3 under the score
    assert nms(boxes, scores, 0.5, max_boxes=1)["indices"].tolist() == [0]
    empty = nms(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), 0.5)
    assert empty["boxes"].shape == (0, 4) and empty["indices"].dtype == np.int64
