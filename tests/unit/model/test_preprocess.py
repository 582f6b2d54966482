"""NumPy preprocessing against hand-computed values, and postprocessing."""

from __future__ import annotations

import numpy as np
import pytest

from tests.models import image_pre
from worker.config import PostprocessConfig
from worker.contract import Request, Tensor, check_image
from worker.flow.errors import InvalidRequest, TensorTooLarge
from worker.model.postprocess import postprocess, softmax, top_k
from worker.model.preprocess import ImagePreprocess, preprocess, resize_bilinear


def test_identity_size_is_exact() -> None:
    img = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    assert np.array_equal(resize_bilinear(img, 2, 2), img.astype(np.float32))


def test_upscale_2x_half_pixel_centres_by_hand() -> None:
    # 1x2 image [0, 100] -> 1x4: src x = (dst + 0.5) * 0.5 - 0.5 = -0.25, 0.25, 0.75, 1.25
    # clamped to [0, 1] -> 0, 0.25, 0.75, 1 -> values 0, 25, 75, 100.
    img = np.array([[[0], [100]]], dtype=np.uint8)
    out = resize_bilinear(img, 1, 4)
    assert out[0, :, 0].tolist() == [0.0, 25.0, 75.0, 100.0]


def test_downscale_2x_averages_pairs() -> None:
    # 2x2 -> 1x1: src = (0 + 0.5) * 2 - 0.5 = 0.5 on both axes: the mean of all four.
    img = np.array([[[10], [20]], [[30], [40]]], dtype=np.uint8)
    assert resize_bilinear(img, 1, 1)[0, 0, 0] == pytest.approx(25.0)


def test_nearest_upscaled_image_resizes_back_exactly() -> None:
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (8, 8, 1), dtype=np.uint8)
    for k in (2, 3, 4):
        big = np.kron(img, np.ones((k, k, 1), dtype=np.uint8))
        assert np.array_equal(resize_bilinear(big, 8, 8), img.astype(np.float32))


def test_normalise_and_layout_nchw_vs_nhwc() -> None:
    img = np.full((4, 4, 3), 255, dtype=np.uint8)
    img[..., 1] = 0
    cfg = image_pre(size=(2, 2), channels=3, mean=(0.5, 0.5, 0.0), std=(0.5, 0.25, 1.0))
    nchw = preprocess([img, img], cfg)
    assert nchw.shape == (2, 3, 2, 2) and nchw.dtype == np.float32
    assert np.allclose(nchw[0, 0], 1.0) and np.allclose(nchw[0, 1], -2.0)
    assert np.allclose(nchw[0, 2], 1.0)
    nhwc = preprocess(
        [img],
        image_pre(
            size=(2, 2),
            channels=3,
            mean=(0.5, 0.5, 0.0),
            std=(0.5, 0.25, 1.0),
            layout="NHWC",
            dtype="float16",
        ),
    )
    assert nhwc.shape == (1, 2, 2, 3) and nhwc.dtype == np.float16
    assert np.allclose(nhwc[0].transpose(2, 0, 1), nchw[0])


def test_varying_input_sizes_in_one_batch() -> None:
    cfg = image_pre(size=(8, 8))
    imgs = [np.zeros((h, w, 1), dtype=np.uint8) for h, w in ((8, 8), (3, 17), (64, 5))]
    out = preprocess(imgs, cfg)
    assert out.shape == (3, 1, 8, 8)
    assert np.allclose(out, -1.0)  # (0/255 - 0.5) / 0.5


def _req(tensor: Tensor) -> Request:
    return Request(v=1, id="r1", inputs={"image": tensor})


def test_check_image_accepts_hw_for_one_channel() -> None:
    img = np.zeros((5, 6), dtype=np.uint8)
    view = check_image(_req(Tensor.from_numpy(img)), "image", 1, 100)
    assert view.shape == (5, 6, 1)


@pytest.mark.parametrize(
    ("arr", "name", "match"),
    [
        (np.zeros((4, 4, 1), np.float32), "image", "dtype"),
        (np.zeros((4, 4, 3), np.uint8), "image", "shape"),
        (np.zeros((4,), np.uint8), "image", "shape"),
        (np.zeros((4, 4, 1), np.uint8), "other", "missing"),
    ],
)
def test_check_image_rejections(arr: np.ndarray, name: str, match: str) -> None:
    req = Request(v=1, id="r1", inputs={name: Tensor.from_numpy(arr)})
    with pytest.raises(InvalidRequest, match=match) as info:
        check_image(req, "image", 1, 1 << 20)
    assert info.value.request_id == "r1"


def test_check_image_too_many_pixels() -> None:
    img = np.zeros((20, 20, 1), dtype=np.uint8)
    with pytest.raises(TensorTooLarge):
        check_image(_req(Tensor.from_numpy(img)), "image", 1, 399)


def test_softmax_and_topk_by_hand() -> None:
    logits = np.array([[0.0, np.log(3.0), 0.0], [1000.0, 0.0, 1000.0]], dtype=np.float32)
    p = softmax(logits)
    assert np.allclose(p[0], [0.2, 0.6, 0.2]) and np.allclose(p[1], [0.5, 0.0, 0.5])
    idx, val = top_k(p, 2)
    assert idx.tolist() == [[1, 0], [0, 2]]  # ties: lower index first
    assert np.allclose(val, [[0.6, 0.2], [0.5, 0.5]])


def test_postprocess_outputs() -> None:
    raw = np.random.default_rng(1).normal(size=(5, 10)).astype(np.float32)
    out = postprocess(raw, PostprocessConfig(top_k=3, include_raw=True), "logits")
    assert set(out) == {"logits", "topk_indices", "topk_scores"}
    assert out["topk_indices"].shape == (5, 3)
    assert np.array_equal(out["topk_indices"][:, 0], raw.argmax(axis=1))
    probs = postprocess(raw, PostprocessConfig(top_k=0), "logits")
    assert set(probs) == {"probabilities"} and np.allclose(probs["probabilities"].sum(1), 1.0)


def _one_by_one(images: list[np.ndarray], cfg: ImagePreprocess) -> np.ndarray:
    """The reference written the plain way: one image at a time."""
    h, w = cfg.size
    rows = []
    for image in images:
        pix = resize_bilinear(image, h, w)
        norm = (pix * np.float32(cfg.scale) - np.asarray(cfg.mean, np.float32)) * (
            np.float32(1.0) / np.asarray(cfg.std, np.float32)
        )
        rows.append(norm.transpose(2, 0, 1) if cfg.layout == "NCHW" else norm)
    return np.stack(rows).astype(cfg.dtype)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grouped_batch_preprocessing_is_bit_identical_to_one_by_one(
    layout: str, dtype: str
) -> None:
    """Images are grouped by size and resized in one vectorised call per group;
    interleaved sizes (non-consecutive groups) must land in their own rows, with
    exactly the per-image reference's values."""
    cfg = image_pre(
        size=(12, 10), channels=3, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.25),
        layout=layout, dtype=dtype,  # type: ignore[arg-type]
    )  # fmt: skip
    rng = np.random.default_rng(7)
    sizes = [(8, 8), (31, 17), (8, 8), (12, 10), (31, 17), (5, 40), (8, 8)]
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    got = preprocess(images, cfg)
    assert np.array_equal(got, _one_by_one(images, cfg))
