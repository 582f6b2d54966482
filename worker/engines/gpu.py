"""The GPU engine protocol, and the one place GPU library errors become ours.

A GPU engine does not take host arrays: it runs on device buffers that a slot
(``worker.buffers.Slot``) allocated once for the largest batch, on that slot's
CUDA stream, so preprocessing, the model and postprocessing are ordered by the
stream alone and the host never waits in between. Buffers never move, so an
engine binds their addresses once per slot (``create_context``) and each batch
only says how many rows are valid (``enqueue``).

The CPU protocol (``Engine.run`` on a NumPy batch) is implemented too by the GPU
engines, so parity with the ONNX Runtime reference can be checked on the same
object; it allocates and synchronises, and is never used by the pipeline.

Errors: CUDA, CuPy, TensorRT and torch raise their own exception types (and
torch mostly a bare ``RuntimeError``). ``translate_gpu_error`` maps them once,
where the engine or the slot calls the library, onto ``InferenceFailed`` (this
batch failed; the device is fine: out of memory, a bad shape) or ``EngineDead``
(the CUDA context is unusable: every later call on it fails too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, EngineDead, InferenceFailed, WorkerError
from . import EngineInfo, resolve_model_path


class EngineUnavailable(ConfigError):
    """The backend's library (or a CUDA device) is missing on this machine. Raised
    when the engine is constructed, never at import, so the worker's modules
    import on any CPU-only host."""

    code = "engine_unavailable"


@dataclass(frozen=True)
class TensorSpec:
    """One engine tensor as the slot allocates it: per-row shape and dtype."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]  # one batch row, without the batch dimension

    @property
    def row_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        return self.row_elements * self.dtype.itemsize


class EngineSlot(Protocol):
    """What an engine sees of a slot; ``worker.buffers.Slot`` implements it."""

    @property
    def index(self) -> int: ...

    @property
    def device(self) -> int: ...

    @property
    def stream(self) -> Any: ...  # cupy.cuda.Stream

    @property
    def engine_input(self) -> Any: ...  # cupy.ndarray [max_batch, *input.shape]

    @property
    def engine_outputs(self) -> Mapping[str, Any]: ...  # name -> cupy.ndarray [max_batch, ...]

    context: Any  # what create_context returned for this slot


class GpuEngine(Protocol):
    """A model that runs on device buffers on a slot's stream.

    ``min_batch_size``..``max_batch_size`` is the range ``enqueue`` accepts (a
    TensorRT optimization profile); the stage pads a smaller batch up to the
    minimum and sizes slot buffers for the maximum. ``enqueue`` only enqueues:
    it returns before the GPU work finishes, and the caller orders everything
    after it on the same stream. It raises ``InferenceFailed`` for this batch or
    ``EngineDead`` when the device is gone.
    """

    info: EngineInfo
    input: TensorSpec
    outputs: tuple[TensorSpec, ...]
    min_batch_size: int
    max_batch_size: int
    device: int

    def create_context(self, slot: EngineSlot) -> Any: ...

    def enqueue(self, slot: EngineSlot, batch_size: int) -> None: ...

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


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


# --- loading -----------------------------------------------------------------------


def load_gpu_engine(
    cfg: ModelConfig, *, device: int = 0, max_batch_size: int = 64, cuda_graphs: bool = False
) -> GpuEngine:
    """The GPU engine for ``cfg.backend`` (``tensorrt`` or ``torch``)."""
    path: Path = resolve_model_path(cfg.path)
    if cfg.backend == "tensorrt":
        from .tensorrt import TensorRTEngine

        return TensorRTEngine(path, cfg, device=device, cuda_graphs=cuda_graphs)
    if cfg.backend == "torch":
        from .torch import TorchEngine

        return TorchEngine(path, cfg, device=device, max_batch_size=max_batch_size)
    raise ConfigError(f"model.backend: {cfg.backend!r} has no GPU engine")


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
