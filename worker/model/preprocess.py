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
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class ImagePreprocess:
    """One image input's preprocessing with every value decided: the settings
    (``[model.preprocess]`` / ``[model.inputs.NAME]``) completed from the model
    input they feed (``worker.model.inputs.image.resolve``). The NumPy reference, the
    kernels and nvJPEG read this, never the settings."""

    size: tuple[int, int]  # (height, width) of the model input
    channels: int
    scale: float
    mean: tuple[float, ...]  # one per channel
    std: tuple[float, ...]
    layout: Literal["NCHW", "NHWC"]
    dtype: Literal["float32", "float16"]
    device: Literal["cpu", "gpu"] = "cpu"

    def batch_shape(self, n: int) -> tuple[int, int, int, int]:
        """``n`` preprocessed images, laid out as the model takes them."""
        h, w = self.size
        return (n, self.channels, h, w) if self.layout == "NCHW" else (n, h, w, self.channels)


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
    out: F32 = resize_bilinear_batch(image[None], out_h, out_w)[0]
    return out


def resize_bilinear_batch(images: np.ndarray, out_h: int, out_w: int) -> F32:
    """uint8 [N, H, W, C] (images of one size) -> float32 [N, out_h, out_w, C].

    One vectorised gather-and-blend for the whole group: per image, exactly the
    arithmetic of the reference (same operations in the same order, so the same
    float32 results), without a Python-level call per image."""
    src = images.astype(np.float32)
    h, w = images.shape[1:3]
    if (h, w) == (out_h, out_w):
        return src
    y0, y1, wy = _axis(h, out_h)
    x0, x1, wx = _axis(w, out_w)
    wx4 = wx[None, None, :, None]
    r0, r1 = src[:, y0], src[:, y1]
    top = r0[:, :, x0] + (r0[:, :, x1] - r0[:, :, x0]) * wx4
    bottom = r1[:, :, x0] + (r1[:, :, x1] - r1[:, :, x0]) * wx4
    out: F32 = top + (bottom - top) * wy[None, :, None, None]
    return out


def preprocess_into(
    images: Sequence[np.ndarray], cfg: ImagePreprocess, out: np.ndarray
) -> np.ndarray:
    """Write the preprocessed batch into ``out[:len(images)]`` (a buffer allocated
    once for the largest batch) and return that view.

    Images are grouped by size and each group is resized, scaled and normalised
    in one vectorised pass (clients tend to send a few sizes, so a batch of 64
    costs a handful of NumPy calls instead of 64 of each)."""
    n = len(images)
    view = out[:n]
    h, w = cfg.size
    scale = np.float32(cfg.scale)
    mean = np.asarray(cfg.mean, dtype=np.float32)
    inv_std = np.float32(1.0) / np.asarray(cfg.std, dtype=np.float32)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault(image.shape, []).append(i)
    for rows in groups.values():
        stack = images[rows[0]][None] if len(rows) == 1 else np.stack([images[i] for i in rows])
        pix = resize_bilinear_batch(stack, h, w)  # [g, h, w, C]
        norm = (pix * scale - mean) * inv_std
        placed = norm.transpose(0, 3, 1, 2) if cfg.layout == "NCHW" else norm
        if len(rows) == rows[-1] - rows[0] + 1:  # consecutive rows: a slice, no scatter
            view[rows[0] : rows[-1] + 1] = placed
        else:
            view[rows] = placed
    return view


def preprocess(images: Sequence[np.ndarray], cfg: ImagePreprocess) -> np.ndarray:
    """Allocating convenience wrapper around ``preprocess_into``."""
    out = np.empty(cfg.batch_shape(len(images)), dtype=np.dtype(cfg.dtype))
    return preprocess_into(images, cfg, out)
