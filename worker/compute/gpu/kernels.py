"""CUDA kernels from ``kernels/*.cu``: compiled once per (device, constants), launched typed.

The model's preprocessing and postprocessing constants (input size, channels,
mean/std, layout, dtype, number of classes, k) are fixed for the life of the
worker, so they are compiled into the kernels as ``#define``s instead of being
passed per launch: the compiler folds them, unrolls the channel loop and the
kernels take no parameter table. NVRTC compiles each (device, file, defines)
combination once (``cupy.RawModule``; CuPy also caches the binary on disk), at
start-up, so a compile error fails the worker before it consumes anything.

Float constants are injected as C hex-float literals of the float32 value the
NumPy reference uses (``np.float32(1) / np.float32(std)`` etc.), so the kernel
computes with exactly the same numbers, not a decimal approximation of them.

CuPy is imported inside functions only: this module imports on CPU-only hosts.
"""

from __future__ import annotations

import importlib
import math
import threading
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Final

import numpy as np

from worker.flow.errors import ConfigError
from worker.model.preprocess import ImagePreprocess

KERNEL_FILES: Final = ("preprocess.cu", "postprocess.cu", "ops.cu")
COMPILE_OPTIONS: Final = ("-std=c++17",)
PREPROCESS_BLOCK: Final = 256
MAX_GRID: Final = 1 << 16  # the kernels loop over the grid, so more blocks would add nothing
POSTPROCESS_MAX_BLOCK: Final = 256

Defines = tuple[tuple[str, str], ...]


def kernel_dir() -> Path:
    """Where the ``.cu`` files are: ``kernels/`` next to the package in a source
    checkout or editable install; ``worker/_kernels/`` when a wheel ships them as
    package data."""
    candidates = [
        Path(__file__).resolve().parents[3] / "kernels",
        Path(str(resources.files("worker") / "_kernels")),
    ]
    for path in candidates:
        if (path / KERNEL_FILES[0]).is_file():
            return path
    searched = ", ".join(str(p) for p in candidates)
    raise ConfigError(f"CUDA kernel sources not found (searched {searched})")


@cache
def kernel_source(name: str) -> str:
    if name not in KERNEL_FILES:
        raise ValueError(f"unknown kernel file {name!r}")
    return (kernel_dir() / name).read_text(encoding="utf-8")


def float_literal(value: float | np.floating[Any]) -> str:
    """An exact C++ literal of ``value`` rounded to float32 (a hex float)."""
    f = np.float32(value)
    if not np.isfinite(f):
        raise ConfigError(f"kernel constant {value!r} is not a finite float32")
    return f"({float(f).hex()}f)"


@lru_cache(maxsize=64)
def preprocess_defines(cfg: ImagePreprocess) -> Defines:
    """The ``#define``s that specialise kernels/preprocess.cu for ``cfg``."""
    h, w = cfg.size
    # Exactly the float32 values worker/preprocess.py computes with.
    mean = np.asarray(cfg.mean, dtype=np.float32)
    inv_std = np.float32(1.0) / np.asarray(cfg.std, dtype=np.float32)
    defines: list[tuple[str, str]] = [
        ("OUT_H", str(h)),
        ("OUT_W", str(w)),
        ("CHANNELS", str(cfg.channels)),
        ("LAYOUT_NCHW", "1" if cfg.layout == "NCHW" else "0"),
        ("OUT_HALF", "1" if cfg.dtype == "float16" else "0"),
        ("SCALE", float_literal(cfg.scale)),
    ]
    for c in range(cfg.channels):
        defines.append((f"MEAN_{c}", float_literal(mean[c])))
        defines.append((f"INV_STD_{c}", float_literal(inv_std[c])))
    return tuple(defines)


def postprocess_block_size(num_classes: int) -> int:
    """Threads per row: a whole number of warps, no more than the row needs."""
    return min(POSTPROCESS_MAX_BLOCK, 32 * math.ceil(num_classes / 32))


@lru_cache(maxsize=64)
def postprocess_defines(
    num_classes: int, top_k: int, softmax: bool, in_dtype: str = "float32"
) -> Defines:
    """The ``#define``s that specialise kernels/postprocess.cu."""
    if in_dtype not in ("float32", "float16"):
        raise ConfigError(f"GPU postprocessing takes float32 or float16 outputs, not {in_dtype}")
    if num_classes < 1:
        raise ConfigError("GPU postprocessing needs at least one value per row")
    return (
        ("NUM_CLASSES", str(num_classes)),
        ("TOP_K", str(max(1, min(top_k, num_classes)))),
        ("APPLY_SOFTMAX", "1" if softmax else "0"),
        ("IN_HALF", "1" if in_dtype == "float16" else "0"),
        ("BLOCK_SIZE", str(postprocess_block_size(num_classes))),
    )


def compile_options(defines: Defines) -> tuple[str, ...]:
    return (*COMPILE_OPTIONS, *(f"-D{name}={value}" for name, value in defines))


# --- modules, once per (device, file, defines) ---------------------------------------

ENTRY_POINTS: Final = {
    "preprocess.cu": ("preprocess_batch",),
    "postprocess.cu": ("softmax_topk", "softmax_rows"),
    # A pipeline's built-in ops, launched by worker/compute/gpu/ops.py.
    "ops.cu": ("crop_resize_pass", "nms_mask"),
}


# Keyed by (the CuPy module's id: CuPy or its twin, device, file, defines).
_modules: dict[tuple[int, int, str, Defines], Any] = {}
_functions: dict[tuple[int, int, str, Defines], dict[str, Any]] = {}
_modules_lock = threading.Lock()


def load_module(name: str, defines: Defines, device: int | None = None, cupy: Any = None) -> Any:
    """The compiled and loaded ``cupy.RawModule`` for ``name`` on ``device``.

    Compiling takes hundreds of milliseconds, so it happens once and under a
    lock (several slot threads may ask at once); every entry point is fetched
    here, which forces compilation and loading now rather than on a hot path.
    ``cupy``: CuPy (the default) or its CPU twin (``worker.compute.gpu.twin``),
    whose modules are the kernels' NumPy references.
    """
    return _load(name, defines, device, cupy)[0]


def kernel(
    name: str, entry: str, defines: Defines, device: int | None = None, cupy: Any = None
) -> Any:
    """The ``cupy.RawKernel`` for one entry point, looked up without allocating."""
    return _load(name, defines, device, cupy)[1][entry]


def _load(name: str, defines: Defines, device: int | None, cupy: Any) -> tuple[Any, dict[str, Any]]:
    if cupy is None:
        cupy = importlib.import_module("cupy")

    dev = int(cupy.cuda.runtime.getDevice()) if device is None else device
    key = (id(cupy), dev, name, defines)
    module = _modules.get(key)
    if module is not None:
        return module, _functions[key]
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            with cupy.cuda.Device(dev):
                module = cupy.RawModule(code=kernel_source(name), options=compile_options(defines))
                functions = {entry: module.get_function(entry) for entry in ENTRY_POINTS[name]}
            _functions[key] = functions
            _modules[key] = module
    return module, _functions[key]


# --- launch wrappers ----------------------------------------------------------------


def preprocess_batch(
    packed: Any,
    table: Any,
    n_images: int,
    out: Any,
    *,
    cfg: ImagePreprocess,
    stream: Any,
    device: int | None = None,
    cupy: Any = None,
) -> None:
    """Enqueue the fused resize + normalise + layout kernel on ``stream``.

    ``packed``: device uint8, the batch's images back to back (C-order HWC);
    ``table``: device int64 [>= n_images, 3] of (byte offset, height, width);
    ``out``: device [>= n_images, *model input] in ``cfg.dtype`` (the engine input).
    Only ``out[:n_images]`` is written.
    """
    if n_images <= 0:
        return
    expected = np.dtype(cfg.dtype)
    if out.dtype != expected:
        raise ValueError(f"preprocess output is {out.dtype}, the model takes {expected}")
    if out.shape[0] < n_images or table.shape[0] < n_images:
        raise ValueError(f"{n_images} images exceed the buffers ({out.shape[0]} rows)")
    if table.dtype != np.int64 or packed.dtype != np.uint8:
        raise ValueError("preprocess takes uint8 packed images and an int64 table")
    fn = kernel("preprocess.cu", "preprocess_batch", preprocess_defines(cfg), device, cupy)
    h, w = cfg.size
    total = n_images * h * w
    grid = min(MAX_GRID, math.ceil(total / PREPROCESS_BLOCK))
    with stream:
        fn((grid,), (PREPROCESS_BLOCK,), (packed, table, np.int32(n_images), out))


def softmax_topk(
    logits: Any,
    n_rows: int,
    out_indices: Any,
    out_scores: Any,
    *,
    top_k: int,
    softmax: bool,
    stream: Any,
    device: int | None = None,
    cupy: Any = None,
) -> None:
    """Enqueue softmax (optional) + top-k over each of the first ``n_rows`` rows.

    ``logits``: device float32/float16 [>= n_rows, ...] (each row flattened);
    ``out_indices``: int64 and ``out_scores``: float32, [>= n_rows, min(top_k, row)].
    """
    if n_rows <= 0:
        return
    num_classes = math.prod(logits.shape[1:])
    k = min(top_k, num_classes)
    if out_indices.dtype != np.int64 or out_scores.dtype != np.float32:
        raise ValueError("top-k outputs are int64 indices and float32 scores")
    for arr in (logits, out_indices, out_scores):
        if arr.shape[0] < n_rows:
            raise ValueError(f"{n_rows} rows exceed a buffer of {arr.shape[0]}")
    if out_indices.shape[1:] != (k,) or out_scores.shape[1:] != (k,):
        raise ValueError(f"top-k buffers must have {k} columns")
    defines = postprocess_defines(num_classes, top_k, softmax, str(logits.dtype))
    fn = kernel("postprocess.cu", "softmax_topk", defines, device, cupy)
    block = postprocess_block_size(num_classes)
    with stream:
        fn((n_rows,), (block,), (logits, np.int32(n_rows), out_indices, out_scores))


def softmax_rows(
    logits: Any,
    n_rows: int,
    out: Any,
    *,
    stream: Any,
    device: int | None = None,
    cupy: Any = None,
) -> None:
    """Enqueue a numerically stable softmax over each of the first ``n_rows`` rows
    (flattened) into float32 ``out`` of the same shape."""
    if n_rows <= 0:
        return
    num_classes = math.prod(logits.shape[1:])
    if out.dtype != np.float32 or math.prod(out.shape[1:]) != num_classes:
        raise ValueError("softmax output must be float32 with the logits' row size")
    if logits.shape[0] < n_rows or out.shape[0] < n_rows:
        raise ValueError(f"{n_rows} rows exceed the buffers")
    # top_k only selects a specialisation that softmax_rows does not use: share it.
    defines = postprocess_defines(num_classes, 1, True, str(logits.dtype))
    fn = kernel("postprocess.cu", "softmax_rows", defines, device, cupy)
    block = postprocess_block_size(num_classes)
    with stream:
        fn((n_rows,), (block,), (logits, np.int32(n_rows), out))
