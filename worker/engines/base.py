"""What every engine is: its description, the two protocols, and model files.

CPU engines (``Engine``) run a preprocessed host batch and return host arrays;
they are called from a worker thread, never on the event loop. GPU engines
(``GpuEngine``) do not take host arrays: they run on device buffers that a slot
(``worker.inference.gpu.slots.Slot``) allocated once for the largest batch, on
that slot's CUDA stream, so preprocessing, the model and postprocessing are
ordered by the stream alone and the host never waits in between. Buffers never
move, so an engine binds their addresses once per slot (``create_context``) and
each batch only says how many rows are valid (``enqueue``).

The CPU protocol (``run`` on a NumPy batch) is implemented by the GPU engines
too, so parity with the ONNX Runtime reference can be checked on the same
object; it allocates and synchronises, and is never used by the pipeline.

Per-batch failures raise ``InferenceFailed``; an engine that can run nothing any
more raises ``EngineDead``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from worker.errors import ConfigError
from worker.model import ModelIO, TensorDesc, resolve_model_path


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    name: str
    version: str  # content hash of the model file: results name exactly what ran
    io: ModelIO  # every input and output, as the model file declares them
    max_batch_size: int | None  # None: any batch size

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.io.output_names

    @property
    def input_name(self) -> str:
        """The first input's name: what a one-input model is fed by."""
        return self.io.inputs[0].name

    @property
    def input_shape(self) -> tuple[int | None, ...]:
        """The first input's row shape, None for each free dimension."""
        return tuple(d if isinstance(d, int) else None for d in self.io.inputs[0].shape)


Feeds = Mapping[str, np.ndarray]
"""One batch's model inputs by name, each with the batch as its first dimension."""


class Engine(Protocol):
    info: EngineInfo

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def content_version(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


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

    def desc(self) -> TensorDesc:
        """As the model description has it (every dimension fixed)."""
        return TensorDesc(self.name, self.dtype, self.shape)


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

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


__all__ = [
    "Engine",
    "EngineInfo",
    "EngineSlot",
    "EngineUnavailable",
    "Feeds",
    "GpuEngine",
    "TensorSpec",
    "content_version",
    "resolve_model_path",  # where engines and tools find model files (worker.model)
]
