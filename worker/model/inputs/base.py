"""What every kind of request input does, and the helpers they share.

A kind turns one request input into one or more model inputs (its *feeds*):
``check`` validates a request's value at intake (on the event loop, so cheap,
and before any engine work, so a bad value is that request's error alone);
``prepare`` does a batch's heavy per-input work on a worker thread (decode image
files, tokenize texts: one call per batch); ``collate`` writes the feeds of a
group of rows, padded on free dimensions. Adding a kind is one module here and
one line in ``worker.model.inputs.binding``'s registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from worker.contract import EncodedImage, InputValue
from worker.flow.errors import InvalidRequest
from worker.model.io import TensorDesc
from worker.model.rows import Row
from worker.model.shapes import dense


class BoundInput(ABC):
    """One request input (``name``) and the model inputs it feeds."""

    kind: ClassVar[str]
    # Whether rows of different lengths may be padded into one run: true only where
    # padding provably changes no answer (a text's attention mask; a tensor the
    # configuration marks ``pad``). Otherwise rows run together only at equal lengths.
    pads: bool = False

    def __init__(self, name: str, feeds: tuple[TensorDesc, ...]) -> None:
        self.name = name
        self.feeds = feeds

    @property
    def field(self) -> str:
        """How messages name the request input: ``inputs.NAME``."""
        return f"inputs.{self.name}"

    @abstractmethod
    def check(self, value: InputValue) -> Any:
        """The value in the form this kind works on; raises ``InvalidRequest`` (or
        ``TensorTooLarge``) with a message naming ``self.field`` and what it expects."""

    def free_symbols(self) -> tuple[str, ...]:
        """The symbols of this input's free dimensions: lengths each request sets."""
        return tuple(dict.fromkeys(s for f in self.feeds for s in f.symbols()))

    def row_ranks(self) -> tuple[int, ...]:
        """The ranks a request's tensor for this input may have (one row)."""
        return tuple(len(f.shape) for f in self.feeds[:1])

    def max_lengths(self) -> Mapping[str, int]:
        """The bound on each padded symbol's length (0: none; a GPU needs one)."""
        return {}

    def lengths(self, row: Any) -> Mapping[str, int]:
        """The row's free-dimension lengths by symbol, when known at intake."""
        return {}

    def pending(self, answers: Sequence[Row]) -> bool:
        """Whether ``prepare`` has work for these answers (the stage skips a thread
        hop when no input has)."""
        return False

    def prepare(self, answers: Sequence[Row]) -> None:  # noqa: B027 (optional hook)
        """Batch work before the rows can be collated, on a worker thread. A row
        that fails gets its ``answer.error`` (``invalid_request``) and is skipped."""

    @abstractmethod
    def collate(
        self, rows: Sequence[Any], padded: Mapping[str, int], out: dict[str, np.ndarray]
    ) -> None:
        """Write the feeds of ``rows`` into ``out`` by feed name, each padded on its
        free axes to ``padded[symbol]``. A buffer already in ``out`` under a feed's
        name (preallocated for the largest batch) is written into and replaced by
        the dense view of the batch (``batch_view``)."""

    def describe(self) -> str:
        feeds = ", ".join(f"{f.name} {f.shown()}" for f in self.feeds)
        return f"{self.name} ({self.kind} -> {feeds})"


class WorkerSetInput(BoundInput):
    """An input the worker sets, never a request: a constant, a sequence's state.
    Every dimension is fixed, and a request that carries it is told who sets it."""

    #: Who sets the input, and what the sender should do instead (the refusal's words).
    set_by: str

    def free_symbols(self) -> tuple[str, ...]:
        return ()

    def check(self, value: InputValue) -> Any:
        raise InvalidRequest(f"{self.field}: {self.set_by}")


def value_kind(value: InputValue) -> str:
    """What a request carried, in the words of the contract."""
    if isinstance(value, EncodedImage):
        return f"an image file ({value.format}, msgpack bin)"
    if isinstance(value, str):
        return "a string"
    return f"a tensor ({value.dtype} {list(value.shape)})"


def pad_rows(
    rows: Sequence[np.ndarray],
    desc: TensorDesc,
    padded: Mapping[str, int],
    pad_value: float,
    out: dict[str, np.ndarray],
) -> None:
    """``rows`` as one batch of ``desc`` into ``out[desc.name]``: fixed axes as they
    are, free axes padded with ``pad_value`` to ``padded[symbol]`` (the rows'
    length, or their longest where the input pads; a compiled length bucket on a
    GPU), stacked at the model input's batch axis. One copy per row; into the
    preallocated buffer already in ``out`` under that name, if any."""
    n = len(rows)
    shape = desc.row_at(padded)
    buffer = out.get(desc.name)
    if buffer is None:
        if all(r.shape == shape for r in rows):
            stacked = np.stack(rows, axis=desc.batch_axis or 0)
            out[desc.name] = stacked.astype(desc.dtype, copy=False)
            return
        view = np.full((n, *shape), pad_value, dtype=desc.dtype)
    else:
        view = dense(buffer, n, shape)
        if any(r.shape != shape for r in rows):
            view.fill(pad_value)
    for i, row in enumerate(rows):
        index: tuple[int | slice, ...] = (i, *(slice(0, s) for s in row.shape))
        view[index] = row
    if desc.batch_axis:  # a state's [layers, batch, hidden]: rows are stacked at its axis
        view = np.ascontiguousarray(np.moveaxis(view, 0, desc.batch_axis))
    out[desc.name] = view
