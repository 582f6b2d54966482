"""The CPU twin's kernels/ops.cu: NumPy references of ``crop_resize_pass`` and
``nms_mask``, called with the kernels' own arguments.

Each computes what its kernel computes from the same tables and the same
specialisation (the ``-D`` defines), by the kernel's algorithm and not by calling
Pillow or the CPU op, so the twin's tests check the launch wrappers, the host
tables and the algorithm against the CPU ops (``worker.compute.ops``); the CUDA
source itself is run on the CPU by tests/unit/compute/test_kernels_compile.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from worker.compute.gpu.resample import PRECISION_BITS, TABLE_COLS

NMS_BLOCK = 64  # kernels/ops.cu's: the bits of one mask word
_HALF = 1 << (PRECISION_BITS - 1)


def _clip8(acc: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)
    return out


def crop_resize_pass(d: Mapping[str, str], src: np.ndarray, table: np.ndarray,
                     h_bounds: np.ndarray, h_coefs: np.ndarray, h_taps: Any,
                     v_bounds: np.ndarray, v_coefs: np.ndarray, v_taps: Any, n: Any,
                     dst: np.ndarray) -> None:  # fmt: skip
    """Box b: dense [R, X, C] at its dst offset; output (r, x), tap i, channel c
    reads src[offset + r*A + x*B + (start + i)*T + c], weighted by the taps of x
    (horizontal) or r (vertical), summed in fixed point, rounded, clipped."""
    out_h, out_w, c = int(d["OUT_H"]), int(d["OUT_W"]), int(d["CHANNELS"])
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    for b, (offset, a, b_step, t, rows, cols, at, axis) in enumerate(
        table.reshape(-1, TABLE_COLS)[: int(n)].tolist()
    ):
        if axis:
            bounds = v_bounds.reshape(-1, out_h, 2)[b][:, None, :]  # by r
            coefs = v_coefs.reshape(-1, out_h, int(v_taps))[b][:, None, :]
        else:
            bounds = h_bounds.reshape(-1, out_w, 2)[b][None, :, :]  # by x
            coefs = h_coefs.reshape(-1, out_w, int(h_taps))[b][None, :, :]
        tap = np.arange(coefs.shape[-1])
        used = tap < bounds[..., 1:2]  # [R or 1, X or 1, taps]
        weight = np.where(used, coefs, 0).astype(np.int64)
        # Past a run's taps the index stays at its start: read, then weighted 0.
        index = (offset + np.arange(rows)[:, None, None] * a + np.arange(cols)[None, :, None]
                 * b_step + (bounds[..., 0:1] + np.where(used, tap, 0)) * t)  # fmt: skip
        pixels = flat_src[index[..., None] + np.arange(c)].astype(np.int64)  # [R, X, taps, c]
        acc = _HALF + (pixels * weight[..., None]).sum(axis=2)
        flat_dst[at : at + rows * cols * c] = _clip8(acc).reshape(-1)


def nms_mask(d: Mapping[str, str], boxes: np.ndarray, order: np.ndarray, n: Any,
             threshold: Any, mask: np.ndarray) -> None:  # fmt: skip
    """Bit j of word (i, j // 64): box j (in score order, j > i) suppressed by box i.
    Words left of a row's own tile stay as they were, as the kernel leaves them."""
    count = int(n)
    b = boxes.reshape(-1, 4)[order[:count]].astype(np.float32)
    x0, y0, x1, y1 = (b[:, k] for k in range(4))
    with np.errstate(invalid="ignore", divide="ignore"):
        area = np.maximum(np.float32(0), x1 - x0) * np.maximum(np.float32(0), y1 - y0)
        w = np.maximum(np.float32(0), np.minimum(x1[:, None], x1) - np.maximum(x0[:, None], x0))
        h = np.maximum(np.float32(0), np.minimum(y1[:, None], y1) - np.maximum(y0[:, None], y0))
        inter = w * h
        union = (area[:, None] + area) - inter
        iou = np.where(union > 0, inter / np.where(union > 0, union, 1), np.float32(0))
        suppress = ~(iou <= np.float32(threshold))
    suppress &= np.arange(count)[None, :] > np.arange(count)[:, None]
    tiles = -(-count // NMS_BLOCK)
    padded = np.zeros((count, tiles * NMS_BLOCK), bool)
    padded[:, :count] = suppress
    words = np.packbits(padded, axis=1, bitorder="little").view("<u8")
    rows = mask.reshape(count, tiles)
    own = np.arange(tiles)[None, :] >= (np.arange(count) // NMS_BLOCK)[:, None]
    rows[own] = words.astype(np.uint64)[own]


KERNELS: dict[str, Callable[..., None]] = {
    "crop_resize_pass": crop_resize_pass,
    "nms_mask": nms_mask,
}
