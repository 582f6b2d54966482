"""What every engine is: its description, the two protocols, and model files.

CPU engines (``Engine``) run a batch of named host arrays (the model's inputs,
``Feeds``) and return host arrays; they are called from a worker thread, never
on the event loop. GPU engines
(``GpuEngine``) do not take host arrays: they run on device buffers that a slot
(``worker.compute.gpu.slots.Slot``) allocated once for the largest batch, on
that slot's CUDA stream, so preprocessing, the model and postprocessing are
ordered by the stream alone and the host never waits in between. Buffers never
move, so an engine binds their addresses once per slot (``create_context``) and
each batch only says how many rows are valid and, for inputs with free
dimensions (text, sequences), at which of the lengths warmed at start-up it
runs (``enqueue``).

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

from worker.flow.errors import ConfigError
from worker.model.io import ModelIO, TensorDesc, resolve_model_path


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


ShapeKey = tuple[int, tuple[tuple[str, int], ...]]
"""A run's shape: its batch bucket and its length per padded symbol."""


def shape_key(batch: int, lengths: Mapping[str, int]) -> ShapeKey:
    """The one key an engine files a shape's graph, context state and output
    shapes under, and finds them by (lengths in symbol order)."""
    return batch, tuple(sorted(lengths.items()))


@dataclass(frozen=True)
class SlotShapes:
    """Every shape a slot's engine runs: the batch buckets, and for each padded
    free dimension (by its symbol, ``worker.model.io``) its length buckets. Every
    combination is run (and compiled, and captured) at start-up, before the
    worker joins its group, so no request waits on a new shape; buffers are
    sized for the largest."""

    batches: tuple[int, ...]
    lengths: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (symbol, ascending buckets)

    @property
    def max_lengths(self) -> dict[str, int]:
        return {symbol: buckets[-1] for symbol, buckets in self.lengths}

    def combos(self) -> list[tuple[int, dict[str, int]]]:
        """Every (batch, lengths) a run may have, largest first (it sizes pools)."""
        lengths: list[dict[str, int]] = [{}]
        for symbol, buckets in self.lengths:
            lengths = [{**known, symbol: b} for known in lengths for b in buckets]
        out = [(batch, known) for batch in self.batches for known in lengths]
        return sorted(out, key=lambda c: (c[0], sorted(c[1].values())), reverse=True)


def row_shape(desc: TensorDesc, lengths: Mapping[str, int]) -> tuple[int, ...]:
    """One row's shape of ``desc`` in a run whose free dimensions have ``lengths``."""
    shape = []
    for axis, dim in enumerate(desc.shape):
        if isinstance(dim, int):
            shape.append(dim)
            continue
        symbol = desc.symbol(axis)
        if symbol not in lengths:
            raise ConfigError(
                f"{desc.name} {desc.shown()}: free dimension {symbol!r} has no bound for the "
                "GPU's buffers (an input's max_length, or an engine profile, sets it)"
            )
        shape.append(lengths[symbol])
    return tuple(shape)


def dense(buffer: Any, n: int, row: tuple[int, ...]) -> Any:
    """``[n, *row]`` over the start of a buffer allocated for the largest batch and
    lengths: the layout engines read and write (CuPy, NumPy or torch arrays)."""
    return buffer.reshape(-1)[: n * math.prod(row)].reshape((n, *row))


class EngineSlot(Protocol):
    """What an engine sees of a slot; ``worker.compute.gpu.slots.Slot`` implements it."""

    @property
    def index(self) -> int: ...

    @property
    def device(self) -> int: ...

    @property
    def stream(self) -> Any: ...  # cupy.cuda.Stream (None for a host slot in tests)

    @property
    def engine_inputs(self) -> Mapping[str, Any]: ...  # name -> [max_batch, *max row]

    @property
    def engine_outputs(self) -> Mapping[str, Any]: ...  # name -> [max_batch, *max row]

    context: Any  # what create_context returned for this slot


class GpuEngine(Protocol):
    """A model that runs on device buffers on a slot's stream.

    ``min_batch_size``..``max_batch_size`` is the range ``enqueue`` accepts (a
    TensorRT optimization profile). Start-up, in order: ``prepare`` with every
    shape the slots will run (``SlotShapes``) sets ``inputs`` and ``outputs`` to
    their largest rows (what slot buffers are sized for); ``create_context`` per
    slot binds its buffers and runs every shape once. Per batch, ``enqueue``
    runs ``batch_size`` rows (padded up to a batch bucket) at ``lengths`` (the
    run's length per padded symbol, one of its buckets), reading every input and
    writing every output densely (``dense``) from the start of its buffer, and
    returns each output's row shape for the run. It only enqueues: it returns
    before the GPU work finishes, and the caller orders everything after it on
    the same stream. It raises ``InferenceFailed`` for this batch or
    ``EngineDead`` when the device is gone.
    """

    info: EngineInfo
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    min_batch_size: int
    max_batch_size: int
    device: int

    def prepare(self, shapes: SlotShapes) -> None: ...

    def create_context(self, slot: EngineSlot) -> Any: ...

    def enqueue(
        self, slot: EngineSlot, batch_size: int, lengths: Mapping[str, int]
    ) -> Mapping[str, tuple[int, ...]]: ...

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


__all__ = [
    "Engine",
    "EngineInfo",
    "EngineSlot",
    "EngineUnavailable",
    "Feeds",
    "GpuEngine",
    "SlotShapes",
    "TensorSpec",
    "content_version",
    "dense",
    "resolve_model_path",
    "row_shape",  # where engines and tools find model files (worker.model.io)
]
