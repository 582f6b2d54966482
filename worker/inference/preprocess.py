"""Preprocessing: the NumPy reference implementation.

Contract (shared with the GPU kernels in kernels/, which must match it within the
tolerance stated in tests/gpu): a uint8 image [H, W, C] (or [H, W] for C = 1) is
resized with bilinear interpolation using half-pixel centres
(``src = (dst + 0.5) * in / out - 0.5``, clamped to the edge, no antialiasing,
the convention of OpenCV's INTER_LINEAR and PyTorch's ``align_corners=False``),
scaled, normalised per channel with mean/std, and laid out NCHW or NHWC in the
model's dtype. Arithmetic is float32 throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from worker.config import PreprocessConfig
from worker.contract import Request
from worker.errors import InvalidRequest, TensorTooLarge

F32 = npt.NDArray[np.float32]


def check_image(
    request: Request, input_name: str, cfg: PreprocessConfig, max_pixels: int
) -> np.ndarray:
    """Validate the model input of one request before any engine work; returns the
    image as a read-only uint8 [H, W, C] view (no copy)."""
    tensor = request.inputs.get(input_name)

    def bad(message: str, cls: type[InvalidRequest] = InvalidRequest) -> InvalidRequest:
        return cls(message, request_id=request.id, meta=request.meta)

    if tensor is None:
        names = ", ".join(sorted(request.inputs)) or "none"
        raise bad(f"inputs.{input_name}: missing (got {names})")
    field = f"inputs.{input_name}"
    if tensor.dtype != "uint8":
        raise bad(f"{field}.dtype: expected uint8, got {tensor.dtype}")
    shape = tensor.shape
    if len(shape) == 2 and cfg.channels == 1:
        shape = (*shape, 1)
    if len(shape) != 3 or shape[2] != cfg.channels:
        raise bad(f"{field}.shape: expected [H, W, {cfg.channels}], got {list(tensor.shape)}")
    h, w, _ = shape
    if h < 1 or w < 1:
        raise bad(f"{field}.shape: height and width must be >= 1")
    if h * w > max_pixels:
        raise bad(f"{field}: {h}x{w} exceeds {max_pixels} pixels", TensorTooLarge)
    return tensor.to_numpy().reshape(shape)


@lru_cache(maxsize=256)
def _axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, F32]:
    """Source indices and weights along one axis (cached: sizes repeat)."""
    scale = np.float32(n_in / n_out)
    src = (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    src = np.clip(src, np.float32(0.0), np.float32(n_in - 1))
    i0 = np.floor(src).astype(np.intp)
    i1 = np.minimum(i0 + 1, n_in - 1)
    frac = (src - i0.astype(np.float32)).astype(np.float32)
    return i0, i1, frac


def resize_bilinear(image: np.ndarray, out_h: int, out_w: int) -> F32:
    """uint8 [H, W, C] -> float32 [out_h, out_w, C] (pixel values unscaled)."""
    src = image.astype(np.float32)
    h, w = image.shape[:2]
    if (h, w) == (out_h, out_w):
        return src
    y0, y1, wy = _axis(h, out_h)
    x0, x1, wx = _axis(w, out_w)
    wx3 = wx[None, :, None]
    top = src[y0][:, x0] + (src[y0][:, x1] - src[y0][:, x0]) * wx3
    bottom = src[y1][:, x0] + (src[y1][:, x1] - src[y1][:, x0]) * wx3
    out: F32 = top + (bottom - top) * wy[:, None, None]
    return out


def batch_shape(cfg: PreprocessConfig, n: int) -> tuple[int, int, int, int]:
    h, w = cfg.size
    return (n, cfg.channels, h, w) if cfg.layout == "NCHW" else (n, h, w, cfg.channels)


def preprocess_into(
    images: Sequence[np.ndarray], cfg: PreprocessConfig, out: np.ndarray
) -> np.ndarray:
    """Write the preprocessed batch into ``out[:len(images)]`` (a buffer allocated
    once for the largest batch) and return that view."""
    n = len(images)
    view = out[:n]
    h, w = cfg.size
    scale = np.float32(cfg.scale)
    mean = np.asarray(cfg.mean, dtype=np.float32)
    inv_std = np.float32(1.0) / np.asarray(cfg.std, dtype=np.float32)
    for i, image in enumerate(images):
        pix = resize_bilinear(image, h, w)  # [h, w, C]
        norm = (pix * scale - mean) * inv_std
        view[i] = norm.transpose(2, 0, 1) if cfg.layout == "NCHW" else norm
    return view


def preprocess(images: Sequence[np.ndarray], cfg: PreprocessConfig) -> np.ndarray:
    """Allocating convenience wrapper around ``preprocess_into``."""
    out = np.empty(batch_shape(cfg, len(images)), dtype=np.dtype(cfg.dtype))
    return preprocess_into(images, cfg, out)
