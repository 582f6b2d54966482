"""Pillow's bilinear resize as tables, for the crop kernels (kernels/ops.cu).

``Image.resize(size, BILINEAR)`` (Pillow's ``libImaging/Resample.c``) resizes in two
separable passes with, per output pixel, a run of source pixels and fixed-point
integer weights computed in double precision: the filter's support is scaled by
the scale factor when it downscales (antialiasing), the weights of a run are
normalised to sum to one and then rounded to ``PRECISION_BITS`` bits. Computing
these tables here, in the same double operations in the same order, and leaving
only the integer sums to the kernel is what makes the GPU crops equal Pillow's
bit for bit: the integer arithmetic has one answer wherever it runs.

Pure NumPy, vectorised over the boxes of a launch (runs padded to the widest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Final

import numpy as np

PRECISION_BITS: Final = 22  # Pillow's 32 - 8 - 2: 8 bits of value, 2 of headroom
BILINEAR_SUPPORT: Final = 1.0
TABLE_COLS: Final = 8  # kernels/ops.cu's per-box table of a pass, described there


def bilinear_coefficients(in_sizes: np.ndarray, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each input length of ``in_sizes`` resampled to ``out_size``, as Pillow's
    ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` do for the bilinear filter.

    Returns ``bounds`` int32 ``[n, out_size, 2]`` (first source index, taps used)
    and ``coefs`` int32 ``[n, out_size, taps]`` (zero past each run's taps), taps
    being the widest run of the ``n``."""
    sizes = np.asarray(in_sizes, dtype=np.int64).reshape(-1)
    if len(sizes) == 0:
        return np.zeros((0, out_size, 2), np.int32), np.zeros((0, out_size, 1), np.int32)
    # Pillow: scale = (double)(in1 - in0) / outSize with the box as floats; a
    # length below 2**24 is exact as a float, so this is the same double.
    scale = sizes.astype(np.float64) / out_size
    filterscale = np.maximum(scale, 1.0)
    support = BILINEAR_SUPPORT * filterscale
    taps = int(np.ceil(support).max()) * 2 + 1
    center = (np.arange(out_size) + 0.5)[None, :] * scale[:, None]  # in0 = 0: 0.0 + v is v
    # (int)(v) truncates towards zero; a negative start is clamped to 0 after.
    first = np.maximum(np.trunc(center - support[:, None] + 0.5), 0).astype(np.int64)
    last = np.minimum(np.trunc(center + support[:, None] + 0.5).astype(np.int64), sizes[:, None])
    count = last - first
    tap = np.arange(taps)
    x = ((first[..., None] + tap).astype(np.float64) - center[..., None] + 0.5) * (
        1.0 / filterscale
    )[:, None, None]
    ax = np.abs(x)
    weights = np.where((ax < 1.0) & (tap < count[..., None]), 1.0 - ax, 0.0)
    # The run's sum in Pillow's order, one tap after another (np.sum would pair them).
    total = np.zeros(center.shape)
    for t in range(taps):
        total = total + weights[..., t]
    weights = np.divide(weights, total[..., None], out=weights.copy(),
                        where=total[..., None] != 0.0)  # fmt: skip
    scaled = weights * float(1 << PRECISION_BITS)
    coefs = np.trunc(np.where(weights < 0, -0.5 + scaled, 0.5 + scaled)).astype(np.int32)
    bounds = np.stack([first, count], axis=-1).astype(np.int32)
    return bounds, coefs


def _pillow_runs_vertical_first() -> bool:
    """Whether the installed Pillow may run the vertical pass first: from 13.0 it
    does where the height shrinks more than twice as much as the width (it reads
    fewer rows then); before, the horizontal pass always ran first. Each order
    rounds its intermediate differently, so the tables follow the installed Pillow,
    which is what the CPU op resizes with."""
    try:
        major = int(version("pillow").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return True
    return major >= 13


PILLOW_VERTICAL_FIRST: Final = _pillow_runs_vertical_first()


def vertical_first(in_h: np.ndarray, in_w: np.ndarray, out_h: int, out_w: int,
                   rule: bool = PILLOW_VERTICAL_FIRST) -> np.ndarray:  # fmt: skip
    """Per box, whether Pillow resizes it vertical pass first."""
    shrink_h = in_h - out_h
    return rule & (shrink_h > 0) & (shrink_h > (in_w - out_w) * 2)


@dataclass(frozen=True)
class CropPlan:
    """One crop launch's host tables: kernels/ops.cu's ``crop_resize_pass``
    arguments for its two passes (source -> intermediate -> crops), copied to the
    device with the images' pixels."""

    size: tuple[int, int]  # the crops' (height, width)
    channels: int
    first: np.ndarray  # int64 [n, TABLE_COLS]: the pass from the source
    second: np.ndarray  # int64 [n, TABLE_COLS]: the pass into the crops
    h_bounds: np.ndarray  # int32 [n, width, 2]
    h_coefs: np.ndarray  # int32 [n, width, h_taps]
    v_bounds: np.ndarray  # int32 [n, height, 2]
    v_coefs: np.ndarray  # int32 [n, height, v_taps]
    tmp_bytes: int  # the intermediates' bytes, all boxes

    @property
    def n_boxes(self) -> int:
        return int(self.first.shape[0])


def clip_boxes(
    boxes: np.ndarray, height: int, width: int, image: int = 0
) -> tuple[np.ndarray, ...]:
    """Boxes (x0, y0, x1, y1) clipped to the image's whole pixels as
    ``worker.compute.ops.crops.crop_boxes`` clips them: left, top, right, bottom
    (int64). A box with no pixel inside is refused, naming it."""
    flat = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    left = np.maximum(0, np.floor(flat[:, 0])).astype(np.int64)
    top = np.maximum(0, np.floor(flat[:, 1])).astype(np.int64)
    right = np.minimum(width, np.ceil(flat[:, 2])).astype(np.int64)
    bottom = np.minimum(height, np.ceil(flat[:, 3])).astype(np.int64)
    empty = np.flatnonzero((right <= left) | (bottom <= top))
    if len(empty):
        k = int(empty[0])
        x0, y0, x1, y1 = flat[k]
        raise ValueError(f"image {image}, box {k} ({x0:g}, {y0:g}, {x1:g}, {y1:g}) holds no "
                         f"pixel of the {width}x{height} image")  # fmt: skip
    return left, top, right, bottom


def crop_plan(
    shapes: Sequence[tuple[int, int]],
    offsets: Sequence[int],
    boxes: Sequence[np.ndarray],
    size: tuple[int, int],
    channels: int,
    rule: bool = PILLOW_VERTICAL_FIRST,
) -> CropPlan:
    """The tables to crop ``boxes[i]`` (``[Ni, 4]`` pixels, clipped) of image ``i``
    (``shapes[i]`` = height, width, its pixels at byte ``offsets[i]`` of the packed
    source) and resize each to ``size`` (height, width): boxes in order, image by
    image. ``rule``: Pillow 13's choice of pass order (else horizontal first)."""
    if not len(shapes) == len(offsets) == len(boxes):
        raise ValueError(f"{len(shapes)} images, {len(offsets)} offsets, {len(boxes)} box sets")
    out_h, out_w = size
    c = channels
    parts = [np.zeros((0, 6), np.int64)]
    for i, ((height, width), offset, image_boxes) in enumerate(
        zip(shapes, offsets, boxes, strict=True)
    ):
        left, top, right, bottom = clip_boxes(image_boxes, height, width, i)
        n = len(left)
        parts.append(np.stack([np.full(n, offset), np.full(n, width * c), left, top,
                               right - left, bottom - top], axis=1))  # fmt: skip
    offset, pitch, left, top, crop_w, crop_h = np.concatenate(parts).T.astype(np.int64)
    n = len(offset)
    h_bounds, h_coefs = bilinear_coefficients(crop_w, out_w)
    v_bounds, v_coefs = bilinear_coefficients(crop_h, out_h)
    vfirst = vertical_first(crop_h, crop_w, out_h, out_w, rule)
    origin = offset + top * pitch + left * c
    # Horizontal first, as Pillow: the pass covers only the crop rows the vertical
    # pass reads (the first run's start .. the last run's end); the vertical bounds
    # then count from there. Vertical first reads the rows the bounds say.
    first_row = np.where(vfirst, 0, v_bounds[:, 0, 0]).astype(np.int64)
    rows = v_bounds[:, -1, 0].astype(np.int64) + v_bounds[:, -1, 1] - first_row
    v_bounds[:, :, 0] -= first_row[:, None].astype(np.int32)
    tmp_sizes = np.where(vfirst, out_h * crop_w, rows * out_w) * c
    tmp_at = np.cumsum(tmp_sizes) - tmp_sizes
    zero, one, channels_ = np.zeros(n, np.int64), np.ones(n, np.int64), np.full(n, c)
    # Columns: src offset, A (per row), B (per column), T (per tap), R, X, dst, axis.
    h_then = np.stack([origin + first_row * pitch, pitch, zero, channels_, rows,
                       np.full(n, out_w), tmp_at, zero], axis=1)  # fmt: skip
    v_then = np.stack([origin, zero, channels_, pitch, np.full(n, out_h), crop_w, tmp_at, one],
                      axis=1)  # fmt: skip
    out_at = np.arange(n, dtype=np.int64) * out_h * out_w * c
    then_v = np.stack([tmp_at, zero, channels_, np.full(n, out_w * c), np.full(n, out_h),
                       np.full(n, out_w), out_at, one], axis=1)  # fmt: skip
    then_h = np.stack([tmp_at, crop_w * c, zero, channels_, np.full(n, out_h), np.full(n, out_w),
                       out_at, zero], axis=1)  # fmt: skip
    first = np.where(vfirst[:, None], v_then, h_then).astype(np.int64)
    second = np.where(vfirst[:, None], then_h, then_v).astype(np.int64)
    return CropPlan(size=(out_h, out_w), channels=c, first=first, second=second,
                    h_bounds=h_bounds, h_coefs=h_coefs, v_bounds=v_bounds, v_coefs=v_coefs,
                    tmp_bytes=int(tmp_sizes.sum()))  # fmt: skip
