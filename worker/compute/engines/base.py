"""What every engine is: the two protocols (the model it serves is described in
``worker.model``: ``EngineInfo``, ``TensorDesc``, ``SlotShapes``).

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

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from worker.flow.errors import ConfigError
from worker.model.io import EngineInfo, TensorDesc
from worker.model.shapes import SlotShapes

Feeds = Mapping[str, np.ndarray]
"""One batch's model inputs by name, each with the batch as its first dimension."""


class Engine(Protocol):
    info: EngineInfo

    def run(self, feeds: Feeds) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class EngineUnavailable(ConfigError):
    """The backend's library (or a CUDA device) is missing on this machine. Raised
    when the engine is constructed, never at import, so the worker's modules
    import on any CPU-only host."""

    code = "engine_unavailable"


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
    inputs: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]
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
    "EngineSlot",
    "EngineUnavailable",
    "Feeds",
    "GpuEngine",
]
