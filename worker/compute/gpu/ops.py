"""A pipeline's built-in ops on the GPU: launch wrappers for kernels/ops.cu (and
preprocess.cu for ``resize``), equal to the CPU ops of ``worker.compute.ops``.

- ``crop_boxes_device``: boxes of several images cropped, clipped and resized in
  one launch pair, bit-exact with ``crops.crop_boxes`` (Pillow's bilinear resize,
  antialiased when it downscales): Pillow's fixed-point weights are computed on
  the host (``resample``), the kernels do the integer sums.
- ``nms_device``: greedy NMS as torchvision's CUDA NMS runs it (stable device sort
  by score, a 64x64-tile IoU bitmask kernel, the greedy walk over the mask on the
  host), the same indices in the same order as ``nms.nms``.
- ``resize_device``: ``preprocess_batch`` (the model inputs' own kernel), equal to
  ``resize``'s ``preprocess`` within tests/gpu/test_gpu_kernels.py's tolerances.

``cupy`` is CuPy or its CPU twin (``worker.compute.gpu.twin``); images and results
are its device arrays; boxes for cropping are host arrays (the weights are
computed on the host from them). Each kernel is compiled once per (device,
defines) by ``kernels.kernel``. Everything is enqueued on ``stream``; only
``nms_device`` waits for it, as its answer decides host work (which regions to
crop). Scratch arrays are allocated inside ``with stream``: CuPy's pool hands a
freed block out again only on the stream it was allocated on, so one freed here
while a kernel still reads it is not overwritten before the kernel is done.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Final

import numpy as np

from worker.compute.engines.cuda import buffer_address
from worker.compute.gpu import kernels
from worker.compute.gpu.resample import CropPlan, crop_plan
from worker.model.preprocess import ImagePreprocess

CROP_BLOCK: Final = 256
NMS_BLOCK: Final = 64  # kernels/ops.cu's: the bits of one mask word
MAX_GRID_Y: Final = 65535
MAX_NMS_BOXES: Final = NMS_BLOCK * MAX_GRID_Y  # a row of tiles per grid y
NMS_DEFINES: Final[kernels.Defines] = ()  # nms_mask has no constants
_H2D: Final = 1  # cudaMemcpyHostToDevice
_D2H: Final = 2
_D2D: Final = 3


@lru_cache(maxsize=64)
def crop_defines(size: tuple[int, int], channels: int) -> kernels.Defines:
    """The ``#define``s that specialise the crop kernels: crop size and channels."""
    height, width = size
    if height < 1 or width < 1 or not 1 <= channels <= 4:
        raise ValueError(f"crops of {height}x{width} with {channels} channels: sizes must be "
                         ">= 1 and channels 1 to 4")  # fmt: skip
    return (("OUT_H", str(height)), ("OUT_W", str(width)), ("CHANNELS", str(channels)))


@dataclass
class Transfers:
    """Copies a pipeline's device work made between host and device (uploads,
    downloads) and on the device (an input taken device to device), counted so
    tests can tell an intermediate stayed on the device between two GPU steps
    (``worker.compute.resident``). Process-wide, for tests: ``reset`` first."""

    uploads: int = 0
    downloads: int = 0
    device_copies: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, kind: str) -> None:
        with self._lock:
            setattr(self, kind, getattr(self, kind) + 1)

    def reset(self) -> None:
        with self._lock:
            self.uploads = self.downloads = self.device_copies = 0


TRANSFERS = Transfers()


def is_device(cupy: Any, array: Any) -> bool:
    """Whether ``array`` is in device memory (a CuPy array, or the twin's)."""
    if getattr(cupy, "twin", False):
        return bool(cupy.is_device(array))
    return not isinstance(array, np.ndarray)


def upload(cupy: Any, host: np.ndarray, stream: Any) -> Any:
    """A device copy of a host array, enqueued on ``stream`` (from pageable memory
    the copy is staged before the call returns, so ``host`` may go at once)."""
    TRANSFERS.count("uploads")
    host = np.ascontiguousarray(host)
    dev = cupy.empty(host.shape, host.dtype)
    if host.nbytes:
        cupy.cuda.runtime.memcpyAsync(buffer_address(dev), host.ctypes.data, host.nbytes, _H2D,
                                      stream.ptr)  # fmt: skip
    return dev


def download(cupy: Any, dev: Any, host: np.ndarray, stream: Any) -> None:
    """``dev`` copied into ``host`` (of its shape and dtype), enqueued on ``stream``:
    ``host`` holds it once the stream is synchronised."""
    TRANSFERS.count("downloads")
    if host.nbytes:
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, buffer_address(dev), host.nbytes, _D2H,
                                      stream.ptr)  # fmt: skip


# --- images packed for one launch ------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """Images back to back in one device buffer (a kernel takes one base pointer and
    byte offsets): ``pixels`` uint8 1-D, image ``i`` at byte ``offsets[i]``,
    ``shapes[i]`` = (height, width), ``channels`` bytes a pixel (C-order HWC). A
    slot's staging, already packed, can be described as one without a copy."""

    pixels: Any
    shapes: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]
    channels: int


def pack_images(cupy: Any, images: Sequence[Any], *, stream: Any) -> Packed:
    """Device images (uint8 ``[H, W, C]`` or ``[H, W]``, C-contiguous, one channel
    count) copied device to device into one buffer, on ``stream``."""
    shapes, offsets, channels, total = [], [], None, 0
    for i, image in enumerate(images):
        c = image.shape[2] if image.ndim == 3 else 1
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or not image.flags.c_contiguous:
            raise ValueError(f"image {i}: expected C-contiguous uint8 [H, W, C], got "
                             f"{image.dtype} {list(image.shape)}")  # fmt: skip
        if channels is not None and c != channels:
            raise ValueError(f"image {i} has {c} channels, image 0 has {channels}")
        channels = c
        shapes.append((int(image.shape[0]), int(image.shape[1])))
        offsets.append(total)
        total += int(image.nbytes)
    with stream:
        pixels = cupy.empty((max(total, 1),), np.uint8)
    base = buffer_address(pixels)
    memcpy = cupy.cuda.runtime.memcpyAsync
    for image, offset in zip(images, offsets, strict=True):
        if image.nbytes:
            memcpy(base + offset, buffer_address(image), int(image.nbytes), _D2D, stream.ptr)
    return Packed(pixels, tuple(shapes), tuple(offsets), channels or 1)


# --- crop_boxes ----------------------------------------------------------------------


def crop_boxes_device(
    cupy: Any,
    images: Sequence[Any],
    boxes: Sequence[np.ndarray],
    size: tuple[int, int],
    *,
    stream: Any,
    device: int | None = None,
) -> Any:
    """``crops.crop_boxes`` on the GPU for several images at once: ``boxes[i]`` (host,
    ``[Ni, 4]`` x0, y0, x1, y1 in pixels, clipped to image ``i``) of device image
    ``images[i]``, each resized to ``size`` (height, width) as Pillow resizes.
    Returns device uint8 ``[sum Ni, height, width, C]``, image by image, box by box.
    A box with no pixel in its image is refused (ValueError) before any launch."""
    return crop_boxes_packed(cupy, pack_images(cupy, images, stream=stream), boxes, size,
                             stream=stream, device=device)  # fmt: skip


def crop_boxes_packed(
    cupy: Any,
    packed: Packed,
    boxes: Sequence[np.ndarray],
    size: tuple[int, int],
    *,
    stream: Any,
    device: int | None = None,
) -> Any:
    """``crop_boxes_device`` for images already packed (``Packed``)."""
    if packed.channels in (2, 4):
        # Pillow resizes LA/RGBA premultiplied by alpha; these kernels do not.
        raise ValueError(f"GPU crops take 1 or 3 channels, not {packed.channels} (Pillow "
                         "premultiplies alpha)")  # fmt: skip
    plan = crop_plan(packed.shapes, packed.offsets, boxes, size, packed.channels)
    return launch_crops(cupy, packed.pixels, plan, stream=stream, device=device)


def launch_crops(
    cupy: Any, pixels: Any, plan: CropPlan, *, stream: Any, device: int | None = None
) -> Any:
    """Enqueue the two passes of ``plan`` over ``pixels`` (device uint8): source ->
    intermediate -> crops, each box in its own pass order."""
    height, width = plan.size
    n = plan.n_boxes
    defines = crop_defines(plan.size, plan.channels)
    with stream:
        out = cupy.empty((n, height, width, plan.channels), np.uint8)
        if n == 0:
            return out
        tables = [upload(cupy, a, stream) for a in (plan.h_bounds, plan.h_coefs, plan.v_bounds,
                                                     plan.v_coefs)]  # fmt: skip
        h_bounds, h_coefs, v_bounds, v_coefs = tables
        tmp = cupy.empty((max(plan.tmp_bytes, 1),), np.uint8)
        fn = kernels.kernel("ops.cu", "crop_resize_pass", defines, device, cupy)
        for pass_table, src, dst in ((plan.first, pixels, tmp), (plan.second, tmp, out)):
            table = upload(cupy, pass_table, stream)
            largest = int((pass_table[:, 4] * pass_table[:, 5]).max())
            grid = (min(kernels.MAX_GRID, math.ceil(largest / CROP_BLOCK)), min(n, MAX_GRID_Y))
            h_taps, v_taps = np.int32(plan.h_coefs.shape[2]), np.int32(plan.v_coefs.shape[2])
            fn(grid, (CROP_BLOCK,), (src, table, h_bounds, h_coefs, h_taps, v_bounds, v_coefs,
                                     v_taps, np.int32(n), dst))  # fmt: skip
    return out


# --- nms -----------------------------------------------------------------------------


def nms_device(
    cupy: Any,
    boxes: Any,
    scores: Any,
    iou_threshold: float,
    score_threshold: float = 0.0,
    max_boxes: int = 0,
    *,
    stream: Any,
    device: int | None = None,
) -> np.ndarray:
    """``nms.nms``'s ``indices`` on the GPU: device float32 ``boxes [N, 4]`` (x0, y0,
    x1, y1) and ``scores [N]``; host int64 indices of the kept boxes, highest score
    first (ties in index order). Waits for ``stream``: the answer is on the host."""
    n = int(boxes.shape[0]) if boxes.ndim == 2 else -1
    if boxes.dtype != np.float32 or scores.dtype != np.float32:
        raise ValueError(f"nms takes float32 boxes and scores, not {boxes.dtype}, {scores.dtype}")
    if boxes.shape != (n, 4) or scores.shape != (n,) or not boxes.flags.c_contiguous:
        raise ValueError(f"nms takes boxes [N, 4] (C-contiguous) and scores [N], not "
                         f"{list(boxes.shape)} and {list(scores.shape)}")  # fmt: skip
    if n > MAX_NMS_BOXES:
        raise ValueError(f"{n} boxes exceed the {MAX_NMS_BOXES} one NMS launch takes")
    if n == 0:
        return np.zeros(0, np.int64)
    tiles = math.ceil(n / NMS_BLOCK)
    fn = kernels.kernel("ops.cu", "nms_mask", NMS_DEFINES, device, cupy)
    with stream:
        # Stable, as the reference's argsort(-scores, kind="stable"): ties keep
        # index order (CuPy's argsort is always stable).
        order = cupy.argsort(-scores)
        mask = cupy.empty((n, tiles), np.uint64)
        fn((tiles, tiles), (NMS_BLOCK,), (boxes, order, np.int32(n),
                                          np.float32(iou_threshold), mask))  # fmt: skip
    host_order = np.empty(n, np.int64)
    host_scores = np.empty(n, np.float32)
    host_mask = np.empty((n, tiles), np.uint64)
    download(cupy, order, host_order, stream)
    download(cupy, scores, host_scores, stream)
    download(cupy, mask, host_mask, stream)
    stream.synchronize()
    kept = greedy_keep(host_mask, host_scores[host_order], score_threshold, max_boxes)
    indices: np.ndarray = host_order[kept]
    return indices


def greedy_keep(
    mask: np.ndarray, sorted_scores: np.ndarray, score_threshold: float, max_boxes: int
) -> np.ndarray:
    """The greedy walk over ``nms_mask``'s words: positions (in score order) kept.

    A box is kept unless an earlier kept box suppresses it; the walk stops at the
    first score under ``score_threshold`` (all after it are lower, NaN last, as
    the sort puts them) or once ``max_boxes`` are kept (0: no limit). Each row is
    read only from its own tile on: the kernel writes no word left of it."""
    passing = sorted_scores >= np.float32(score_threshold)  # compared as float32, as NumPy does
    limit = len(passing) if passing.all() else int(np.argmin(passing))
    removed = np.zeros(mask.shape[1], np.uint64)
    kept: list[int] = []
    for i in range(limit):
        tile = i // NMS_BLOCK
        if (int(removed[tile]) >> (i % NMS_BLOCK)) & 1:
            continue
        kept.append(i)
        if len(kept) == max_boxes:
            break
        removed[tile:] |= mask[i, tile:]
    return np.asarray(kept, np.int64)


# --- resize --------------------------------------------------------------------------


def resize_device(
    cupy: Any,
    images: Sequence[Any],
    cfg: ImagePreprocess,
    *,
    stream: Any,
    device: int | None = None,
) -> Any:
    """``op = "resize"`` on the GPU: device images (uint8 ``[H, W, C]``) resized and
    normalised by the model inputs' own kernel (``kernels.preprocess_batch``) into
    device ``cfg.batch_shape(n)`` in ``cfg.dtype``."""
    packed = pack_images(cupy, images, stream=stream)
    if images and packed.channels != cfg.channels:
        raise ValueError(f"images have {packed.channels} channels, the resize makes "
                         f"{cfg.channels}")  # fmt: skip
    n = len(images)
    table = np.array(
        [(o, h, w) for o, (h, w) in zip(packed.offsets, packed.shapes, strict=True)], np.int64
    ).reshape(-1, 3)
    with stream:
        out = cupy.empty(cfg.batch_shape(n), np.dtype(cfg.dtype))
        dev_table = upload(cupy, table, stream)
    kernels.preprocess_batch(packed.pixels, dev_table, n, out, cfg=cfg, stream=stream,
                             device=device, cupy=cupy)  # fmt: skip
    return out
