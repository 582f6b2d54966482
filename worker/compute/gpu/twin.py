"""The GPU stage's CPU twin: NumPy standing in for the CuPy calls the stage makes.

``model.backend = "gpu-twin"`` runs a model through the GPU stage's own code
(``worker.compute.gpu``: slots and their ring, the launcher's collation into
pinned twins and its copies by address, chunking, the kernels' launch wrappers,
completion, the memory share) on a machine without a device, with ONNX Runtime
as the engine (``worker.compute.engines.twin``). It exists so that what the GPU
stage does with several models, pipelines and memory budgets is tested on every
machine; it is not fast and proves nothing about CUDA itself (streams here run
each call at once, in order; nothing overlaps).

What stands in for what:

- device memory is host memory: ``zeros`` returns a NumPy array, counted by the
  default memory pool (``total_bytes``; ``set_limit`` makes a larger allocation
  fail as CuPy's pool does, with an ``OutOfMemoryError``) while it lives;
- ``memcpyAsync`` copies bytes between addresses at once (``ctypes.memmove``):
  the launcher's copies by address are the real code path;
- a stream runs what is enqueued on it at once, so an event records the time it
  was reached and ``launch_host_func`` calls its function before returning;
- ``RawModule`` compiles nothing: each kernel entry point is the NumPy reference
  the real kernel is tested against (``worker.model.preprocess``,
  ``worker.model.postprocess``; kernels/ops.cu's in ``twin_ops``), specialised by
  the same ``-D`` defines;
- ``empty`` is ``zeros`` (counted the same), ``argsort`` NumPy's stable one, as
  CuPy's is; ``stack``, ``concatenate`` and ``ascontiguousarray`` NumPy's (a
  device array's rows gathered on the device);
- a device array is a NumPy array the pool allocated (or a view of one):
  ``is_device`` tells it from a host array, as ``isinstance(x, cupy.ndarray)``
  does on a GPU, so tests can see where a pipeline's intermediates are;
- the device has ``TWIN_MEMORY_BYTES`` (16 GiB), or ``INFER_WORKER_TWIN_MEMORY_MB``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, Final

import numpy as np

from worker.compute.gpu import twin_ops
from worker.model.postprocess import softmax, top_k
from worker.model.preprocess import resize_bilinear_batch

TWIN_MEMORY_BYTES: Final = 16 * 2**30
_MEMORY_ENV: Final = "INFER_WORKER_TWIN_MEMORY_MB"
_pointers = itertools.count(1)


class OutOfMemoryError(MemoryError):
    """As CuPy's: its type name is what ``translate_gpu_error`` recognises."""


def total_memory() -> int:
    mib = os.environ.get(_MEMORY_ENV, "").strip()
    return int(float(mib) * 2**20) if mib else TWIN_MEMORY_BYTES


class MemoryPool:
    """The bytes the twin's device arrays hold while they live, with CuPy's limit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = 0
        self._limit = 0  # 0: none
        # The arrays it allocated, while they live (id -> weak reference): what
        # ``is_device`` recognises.
        self._live: dict[int, weakref.ref[np.ndarray]] = {}

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        self._limit = int(total_memory() * fraction) if fraction is not None else int(size or 0)

    def total_bytes(self) -> int:
        return self._held

    def used_bytes(self) -> int:
        return self._held

    def allocate(self, shape: Sequence[int] | int, dtype: Any) -> np.ndarray:
        arr = np.zeros(shape, dtype=dtype)
        nbytes = int(arr.nbytes)
        with self._lock:
            if self._limit and self._held + nbytes > self._limit:
                raise OutOfMemoryError(
                    f"out of memory allocating {nbytes:,} bytes "
                    f"(total {self._held + nbytes:,} bytes, limit {self._limit:,})"
                )
            self._held += nbytes
            self._live[id(arr)] = weakref.ref(arr)
        weakref.finalize(arr, self._free, nbytes, id(arr))
        return arr

    def _free(self, nbytes: int, key: int) -> None:
        with self._lock:
            self._held -= nbytes
            self._live.pop(key, None)

    def allocated(self, arr: np.ndarray) -> bool:
        """Whether ``arr`` is (a view of) an array this pool allocated and holds."""
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        ref = self._live.get(id(root))
        return ref is not None and ref() is root


class Stream:
    """Runs what is enqueued on it at once (see the module doc)."""

    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = next(_pointers)
        self.non_blocking = non_blocking

    def synchronize(self) -> None:
        return None

    def launch_host_func(self, fn: Callable[[Any], None], arg: Any) -> None:
        fn(arg)

    def wait_event(self, event: Event) -> None:
        """Work enqueued after waits for ``event``: here, it has happened."""
        return None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ptr = next(_pointers)
        self.at = time.perf_counter()

    def record(self, stream: Stream | None = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        return None

    @property
    def done(self) -> bool:
        return True


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _memcpy(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def _elapsed_ms(start: Event, end: Event) -> float:
    return (end.at - start.at) * 1e3


def _properties(device: int) -> dict[str, Any]:
    return {"name": b"CPU twin", "major": 0, "minor": 0, "totalGlobalMem": total_memory()}


def _no_pci(device: int) -> str:
    raise RuntimeError("the CPU twin has no PCI bus id")


def _defines(options: Sequence[str]) -> dict[str, str]:
    """``-DNAME=VALUE`` options as the kernels' compile options carry them."""
    return dict(o[2:].split("=", 1) for o in options if o.startswith("-D"))


def _float(literal: str) -> np.float32:
    """A hex-float literal as ``kernels.float_literal`` writes it: ``(0x1.8p+0f)``."""
    return np.float32(float.fromhex(literal.strip("()").removesuffix("f")))


class _Kernel:
    """One entry point: called as CuPy calls a kernel, ``fn(grid, block, args)``."""

    def __init__(self, run: Callable[..., None]) -> None:
        self._run = run

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 **kwargs: Any) -> None:  # fmt: skip
        self._run(*args)


class RawModule:
    """A ``kernels/*.cu`` file as its entry points' NumPy references."""

    def __init__(self, code: str = "", options: Sequence[str] = (), **kwargs: Any) -> None:
        self._d = _defines(options)

    def get_function(self, name: str) -> _Kernel:
        runs: dict[str, Callable[..., None]] = {
            "preprocess_batch": self._preprocess,
            "softmax_topk": self._softmax_topk,
            "softmax_rows": self._softmax_rows,
        }
        if name in twin_ops.KERNELS:
            return _Kernel(functools.partial(twin_ops.KERNELS[name], self._d))
        if name not in runs:
            raise AttributeError(f"the CPU twin has no kernel {name!r}")
        return _Kernel(runs[name])

    def _preprocess(self, packed: np.ndarray, table: np.ndarray, n: Any, out: np.ndarray) -> None:
        d = self._d
        h, w, c = int(d["OUT_H"]), int(d["OUT_W"]), int(d["CHANNELS"])
        scale = _float(d["SCALE"])
        mean = np.array([_float(d[f"MEAN_{i}"]) for i in range(c)], dtype=np.float32)
        inv_std = np.array([_float(d[f"INV_STD_{i}"]) for i in range(c)], dtype=np.float32)
        for i in range(int(n)):
            offset, height, width = (int(v) for v in table[i])
            image = packed[offset : offset + height * width * c].reshape(1, height, width, c)
            norm = (resize_bilinear_batch(image, h, w) * scale - mean) * inv_std
            out[i] = norm[0].transpose(2, 0, 1) if d["LAYOUT_NCHW"] == "1" else norm[0]

    def _softmax_topk(
        self, logits: np.ndarray, n: Any, indices: np.ndarray, scores: np.ndarray
    ) -> None:
        rows = logits[: int(n)].reshape(int(n), -1).astype(np.float32)
        values = softmax(rows) if self._d["APPLY_SOFTMAX"] == "1" else rows
        k = indices.shape[1]
        indices[: int(n)], scores[: int(n)] = top_k(values, k)

    def _softmax_rows(self, logits: np.ndarray, n: Any, out: np.ndarray) -> None:
        rows = logits[: int(n)].reshape(int(n), -1)
        out[: int(n)] = softmax(rows).reshape(out[: int(n)].shape)


def make() -> Any:
    """A fresh twin of the ``cupy`` module: the attributes the GPU stage uses."""
    pool = MemoryPool()
    runtime = SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDevice=lambda: 0,
        memGetInfo=lambda: (total_memory() - pool.total_bytes(), total_memory()),
        deviceSynchronize=lambda: None,
        memcpyAsync=_memcpy,
        eventQuery=lambda ptr: 0,
        getDeviceProperties=_properties,
        deviceGetPCIBusId=_no_pci,
    )
    current = Stream()
    cuda = SimpleNamespace(
        runtime=runtime,
        Device=Device,
        Stream=Stream,
        Event=Event,
        get_elapsed_time=_elapsed_ms,
        alloc_pinned_memory=bytearray,
        get_current_stream=lambda: current,
    )
    return SimpleNamespace(
        cuda=cuda,
        zeros=pool.allocate,
        empty=pool.allocate,
        argsort=functools.partial(np.argsort, kind="stable"),
        RawModule=RawModule,
        get_default_memory_pool=lambda: pool,
        asnumpy=np.asarray,
        stack=np.stack,
        concatenate=np.concatenate,
        ascontiguousarray=np.ascontiguousarray,
        is_device=lambda arr: isinstance(arr, np.ndarray) and pool.allocated(arr),
        twin=True,
    )


_shared: dict[str, Any] = {}
_shared_lock = threading.Lock()


def cupy() -> Any:
    """The process's one twin (one device, one memory pool), made on first use."""
    with _shared_lock:
        if "cupy" not in _shared:
            _shared["cupy"] = make()
        return _shared["cupy"]


def cupy_for(backend: str) -> Any:
    """The CuPy a GPU backend's stage runs on: CuPy with a device, or for
    ``gpu-twin`` the process's twin."""
    if backend == "gpu-twin":
        return cupy()
    from worker.compute.engines.cuda import import_cupy

    return import_cupy()
