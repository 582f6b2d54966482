"""CUDA helpers shared by the GPU engines and the GPU stage, and the one place
GPU library errors become ours.

CUDA, CuPy, TensorRT and torch raise their own exception types (and torch mostly
a bare ``RuntimeError``). ``translate_gpu_error`` maps them once, where the
engine or the slot calls the library, onto ``InferenceFailed`` (this batch
failed; the device is fine: out of memory, a bad shape) or ``EngineDead`` (the
CUDA context is unusable: every later call on it fails too).
"""

from __future__ import annotations

from typing import Any, Final

from worker.compute.engines.base import EngineUnavailable
from worker.flow.errors import EngineDead, InferenceFailed, WorkerError

# --- error translation -------------------------------------------------------------

# cudaError_t / CUresult values after which the CUDA context is unusable ("sticky"
# errors: every later call in the process fails) or the device is gone. The runtime
# and driver enums share these numbers.
STICKY_CUDA_ERRORS: Final = frozenset(
    {
        3,  # initialization error
        4,  # cudart unloading / driver deinitialised
        46,  # devices unavailable
        100,  # no device
        214,  # ECC uncorrectable
        220,  # NVLink uncorrectable
        700,  # illegal address
        702,  # launch timeout
        709,  # context is destroyed
        710,  # device-side assert
        714,  # hardware stack error
        715,  # illegal instruction
        716,  # misaligned address
        717,  # invalid address space
        718,  # invalid program counter
        719,  # launch failure
        999,  # unknown
    }
)
CUDA_OUT_OF_MEMORY: Final = 2
CUDA_NOT_READY: Final = 600  # cudaErrorNotReady: the queried work is still running

# torch reports CUDA failures as RuntimeError text ("CUDA error: an illegal memory
# access was encountered"); these fragments name the sticky ones.
_DEAD_MESSAGES: Final = (
    "illegal memory access",
    "illegal address",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "uncorrectable ecc",
    "hardware stack error",
    "no cuda gpus are available",
    "cuda error: unknown error",
    "context is destroyed",
    "device has fallen off the bus",
)


def buffer_address(array: Any) -> int:
    """The first byte's address of a CuPy (device) or NumPy (host) array: what a
    zero-copy DLPack import must point at."""
    data = array.data
    return int(data.ptr) if hasattr(data, "ptr") else int(array.ctypes.data)


def cuda_status(exc: BaseException) -> int | None:
    """The CUDA status code carried by a CuPy runtime/driver error, if any."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


def cuda_status_error(status: int, where: str) -> WorkerError:
    """The worker error for a failed CUDA call's status code."""
    text = f"{where}: CUDA status {status}"
    if status in STICKY_CUDA_ERRORS:
        return EngineDead(f"{text} (the device context is unusable)")
    return InferenceFailed(text)


def event_completed(cupy: Any, event: Any) -> bool:
    """Whether ``event`` has completed, without blocking.

    ``cupy.cuda.Event.done`` is ``cudaEventQuery(...) == cudaSuccess``, so it is
    False both while the work runs and after the context failed; the status itself
    tells them apart, and a failure raises ``EngineDead`` / ``InferenceFailed``.
    """
    status = int(cupy.cuda.runtime.eventQuery(event.ptr))
    if status == 0:
        return True
    if status == CUDA_NOT_READY:
        return False
    raise cuda_status_error(status, "event query")


def translate_gpu_error(exc: BaseException, where: str) -> WorkerError:
    """Map a third-party GPU exception onto the worker's vocabulary (see module doc).
    Our own errors pass through unchanged."""
    if isinstance(exc, WorkerError):
        return exc
    text = f"{where}: {type(exc).__name__}: {exc}"
    status = cuda_status(exc)
    if status is not None:
        if status in STICKY_CUDA_ERRORS:
            return EngineDead(f"{text} (CUDA status {status}: the device context is unusable)")
        return InferenceFailed(text)
    message = str(exc).lower()
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in message:
        return InferenceFailed(text)
    if any(fragment in message for fragment in _DEAD_MESSAGES):
        return EngineDead(text)
    return InferenceFailed(text)


def import_cupy() -> Any:
    """CuPy with at least one CUDA device, or ``EngineUnavailable`` saying why not."""
    try:
        import cupy
    except ImportError as exc:
        raise EngineUnavailable(
            "the GPU path needs CuPy: pip install -e '.[gpu]' "
            "(cupy-cuda12x; cupy-cuda13x on CUDA 13)"
        ) from exc
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # boundary: CuPy raises CUDARuntimeError without a driver
        raise EngineUnavailable(f"CUDA is not usable on this machine: {exc}") from exc
    if count == 0:
        raise EngineUnavailable("no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    return cupy


def gpu_name(device: int = 0) -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def compute_capability(device: int) -> tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return int(props["major"]), int(props["minor"])
