"""The CUDA kernels against the NumPy reference, on a GPU.

Tolerances (the contract DESIGN.md asks for):

- preprocessing, float32 output: ``atol = 1e-5`` on normalised values. The kernel
  uses explicitly rounded float32 operations in the reference's order, so the
  expected difference is 0 (tests/unit/test_kernels_compile.py proves the source
  bit-exact on the CPU); 1e-5 leaves room for nothing but a compiler surprise
  and is still ~100x below one uint8 step after normalisation (1/255/std).
- preprocessing, float16 output: ``atol = 2e-3``: two float16 ulps at |x| ~ 1-2
  (the ulp there is ~1e-3); both sides round the same float32 to nearest-even,
  so again 0 is expected.
- softmax scores: ``rtol = 1e-5, atol = 1e-6``: CUDA's ``expf`` is within 2 ulp of
  the exact value and the row sum is accumulated in a different order than
  NumPy's pairwise sum; probabilities are in [0, 1].
- top-k indices: exactly equal where the reference's scores are separated by
  more than the score tolerance (on rows built so they are); raw (no softmax)
  scores and indices, ties included, exactly equal.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import pytest

from tests.models import image_pre
from worker.compute.gpu import kernels
from worker.compute.gpu.slots import pack_images
from worker.model.postprocess import softmax, top_k
from worker.model.preprocess import ImagePreprocess, preprocess

pytestmark = pytest.mark.gpu

ATOL_F32 = 1e-5
ATOL_F16 = 2e-3
SOFTMAX_RTOL = 1e-5
SOFTMAX_ATOL = 1e-6

CONFIGS = {
    "digits-nchw-f32": image_pre(),
    "rgb-nhwc-f32": image_pre(
        size=(224, 224), channels=3, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
        layout="NHWC",
    ),
    "rgb-nchw-f16": image_pre(
        size=(64, 48), channels=3, mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0), dtype="float16",
    ),
    "rgba-nhwc-f16": image_pre(
        size=(17, 31), channels=4, mean=(0.1, 0.2, 0.3, 0.4), std=(1.0, 2.0, 3.0, 0.5),
        layout="NHWC", dtype="float16",
    ),
}  # fmt: skip

# Odd, tiny, identity-sized, extreme aspect ratios, up- and downscaling.
SIZES = [(1, 1), (2, 3), (7, 5), (8, 8), (17, 31), (31, 17), (64, 48), (224, 224), (333, 111),
         (480, 640), (1, 300), (300, 1)]  # fmt: skip


def _random_images(rng: np.random.Generator, n: int, channels: int) -> list[np.ndarray]:
    if n == 1:  # a single odd-sized image, downscaled on one axis, upscaled on the other
        return [rng.integers(0, 256, (333, 7, channels), dtype=np.uint8)]
    images = []
    for i in range(n):
        h, w = SIZES[i] if i < len(SIZES) else (int(v) for v in rng.integers(1, 400, 2))
        images.append(rng.integers(0, 256, (h, w, channels), dtype=np.uint8))
    return images


def _gpu_preprocess(cp: Any, images: list[np.ndarray], cfg: ImagePreprocess) -> np.ndarray:
    total = sum(img.size for img in images)
    packed = np.zeros(total, np.uint8)
    table = np.zeros((len(images), 3), np.int64)
    pack_images(images, packed, table)
    stream = cp.cuda.Stream(non_blocking=True)
    # Everything on the kernel's stream: a non-blocking stream is not ordered after
    # work on CuPy's default (legacy null) stream, so a NaN fill or a copy issued
    # there could still be running when the kernel starts.
    with stream:
        out = cp.full(cfg.batch_shape(len(images) + 2), np.nan, dtype=cfg.dtype)
        d_packed, d_table = cp.asarray(packed), cp.asarray(table)
    kernels.preprocess_batch(d_packed, d_table, len(images), out, cfg=cfg, stream=stream)
    stream.synchronize()
    host = cp.asnumpy(out)
    assert np.isnan(host[len(images) :].astype(np.float32)).all(), "wrote past n_images"
    result: np.ndarray = host[: len(images)]
    return result


@pytest.mark.parametrize("batch", [1, "max"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_preprocess_matches_numpy(cp: Any, name: str, batch: int | str) -> None:
    cfg = CONFIGS[name]
    n = 1 if batch == 1 else (64 if cfg.size[0] * cfg.size[1] < 10_000 else 16)
    rng = np.random.default_rng(zlib.crc32(name.encode()) + n)
    images = _random_images(rng, n, cfg.channels)
    got = _gpu_preprocess(cp, images, cfg)
    want = preprocess(images, cfg)
    assert got.dtype == want.dtype and got.shape == want.shape
    atol = ATOL_F32 if cfg.dtype == "float32" else ATOL_F16
    diff = np.abs(got.astype(np.float32) - want.astype(np.float32))
    assert diff.max() <= atol, f"max |gpu - numpy| = {diff.max()} > {atol}"


def test_preprocess_of_single_channel_2d_images(cp: Any) -> None:
    cfg = image_pre()
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w), dtype=np.uint8) for h, w in [(5, 9), (8, 8)]]
    got = _gpu_preprocess(cp, images, cfg)
    want = preprocess([img[..., None] for img in images], cfg)
    assert np.abs(got - want).max() <= ATOL_F32


def _separated_logits(rng: np.random.Generator, rows: int, classes: int) -> np.ndarray:
    """Logits whose softmax values differ by far more than the score tolerance, so
    the top-k order is unambiguous."""
    base = np.stack([rng.permutation(classes) for _ in range(rows)]).astype(np.float32)
    return base * np.float32(10.0 / classes) + rng.normal(0, 1, (rows, 1)).astype(np.float32)


def _topk_gpu(
    cp: Any, logits: np.ndarray, k: int, apply_softmax: bool
) -> tuple[np.ndarray, np.ndarray]:
    n = logits.shape[0]
    kk = min(k, int(np.prod(logits.shape[1:])))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # see _gpu_preprocess: inputs ready on the kernel's own stream
        d_logits = cp.asarray(logits)
        idx = cp.full((n + 1, kk), -7, dtype=cp.int64)
        scores = cp.zeros((n + 1, kk), dtype=cp.float32)
    kernels.softmax_topk(d_logits, n, idx, scores, top_k=k, softmax=apply_softmax, stream=stream)
    stream.synchronize()
    host_idx = cp.asnumpy(idx)
    assert (host_idx[n] == -7).all(), "wrote past n_rows"
    return host_idx[:n], cp.asnumpy(scores)[:n]


@pytest.mark.parametrize(("classes", "k"), [(10, 3), (1000, 5), (1001, 1), (3, 5), (21843, 5)])
def test_softmax_topk_matches_numpy(cp: Any, classes: int, k: int) -> None:
    rng = np.random.default_rng(classes)
    logits = _separated_logits(rng, 37, classes)
    idx, scores = _topk_gpu(cp, logits, k, apply_softmax=True)
    want_idx, want_scores = top_k(softmax(logits), k)
    assert idx.dtype == np.int64 and scores.dtype == np.float32
    assert np.array_equal(idx, want_idx)
    np.testing.assert_allclose(scores, want_scores, rtol=SOFTMAX_RTOL, atol=SOFTMAX_ATOL)


def test_topk_without_softmax_is_exact_with_ties_to_the_lower_index(cp: Any) -> None:
    rng = np.random.default_rng(5)
    logits = rng.integers(-3, 4, (64, 50)).astype(np.float32)  # many ties
    logits[0] = 1.0  # all equal: indices 0..k-1
    logits[1, [3, 7, 40]] = 9.0
    idx, scores = _topk_gpu(cp, logits, 5, apply_softmax=False)
    want_idx, want_scores = top_k(logits, 5)
    assert np.array_equal(idx, want_idx)
    assert np.array_equal(scores, want_scores)
    assert idx[0].tolist() == [0, 1, 2, 3, 4]
    assert idx[1, :3].tolist() == [3, 7, 40]


def test_topk_half_logits(cp: Any) -> None:
    rng = np.random.default_rng(6)
    logits = _separated_logits(rng, 8, 100).astype(np.float16)
    idx, scores = _topk_gpu(cp, logits, 4, apply_softmax=False)
    want_idx, want_scores = top_k(logits.astype(np.float32), 4)
    assert np.array_equal(idx, want_idx) and np.array_equal(scores, want_scores)


def test_nan_rows_follow_numpy(cp: Any) -> None:
    logits = np.array([[1.0, np.nan, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]], np.float32)
    idx, scores = _topk_gpu(cp, logits, 2, apply_softmax=True)
    want_idx, want_scores = top_k(softmax(logits), 2)
    assert np.array_equal(idx, want_idx)
    assert np.isnan(scores[0]).all() and np.isnan(want_scores[0]).all()
    np.testing.assert_allclose(scores[1], want_scores[1], rtol=SOFTMAX_RTOL)
    raw_idx, _ = _topk_gpu(cp, logits, 4, apply_softmax=False)
    assert np.array_equal(raw_idx, top_k(logits, 4)[0])  # NaN sorts last


@pytest.mark.parametrize("classes", [10, 1000])
def test_softmax_rows_matches_numpy(cp: Any, classes: int) -> None:
    rng = np.random.default_rng(classes + 1)
    logits = rng.normal(0, 5, (9, classes)).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # see _gpu_preprocess: inputs ready on the kernel's own stream
        out = cp.zeros((9, classes), dtype=cp.float32)
        d_logits = cp.asarray(logits)
    kernels.softmax_rows(d_logits, 9, out, stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(
        cp.asnumpy(out), softmax(logits), rtol=SOFTMAX_RTOL, atol=SOFTMAX_ATOL
    )


def test_modules_are_compiled_once_per_device_and_defines(cp: Any) -> None:
    cfg = CONFIGS["digits-nchw-f32"]
    a = kernels.load_module("preprocess.cu", kernels.preprocess_defines(cfg), 0)
    b = kernels.load_module("preprocess.cu", kernels.preprocess_defines(cfg), 0)
    other = dataclasses.replace(cfg, layout="NHWC")
    c = kernels.load_module("preprocess.cu", kernels.preprocess_defines(other), 0)
    assert a is b and a is not c
