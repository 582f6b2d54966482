"""``kind = "tensor"``: the request carries the model input itself, one row of it.

The tensor must have the model input's dtype (no silent conversion: a float64
sent to a float32 input is a client bug worth hearing about) and its rank;
fixed dimensions must match, free ones may differ per request (at least 1,
at most ``max_length``). Requests run together only at equal free dimensions,
unless the configuration marks the input ``pad``: then rows are padded per run
with ``pad_value`` (the operator vouches that padding changes no answer, as a
padding id whose embedding is zero does; start-up checks every output that
follows the padded dimension can be cut back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker.config.model import TensorInput
from worker.contract import InputValue, Tensor
from worker.flow.errors import InvalidRequest, TensorTooLarge
from worker.model.inputs.base import BoundInput, pad_rows, value_kind
from worker.model.io import TensorDesc


class BoundTensor(BoundInput):
    kind = "tensor"

    def __init__(self, name: str, cfg: TensorInput, feed: TensorDesc, max_length: int) -> None:
        """``max_length``: the bound on free dimensions (0: none)."""
        super().__init__(name, (feed,))
        self.desc = feed
        self._dtype = feed.dtype.name  # numpy computes ``dtype.name`` per call (2 us)
        self.pads = bool(cfg.pad)
        self.pad_value = cfg.pad_value or 0.0
        self.max_length = max_length
        self._symbols = {axis: feed.symbol(axis) for axis in feed.free_axes}

    def check(self, value: InputValue | np.ndarray) -> np.ndarray:
        """A request's tensor (or a pipeline step's array: ``ModelInputs.check_arrays``)
        held to the input's dtype and shape; its rows as a numpy array, no copy."""
        desc = self.desc
        if not isinstance(value, Tensor | np.ndarray):
            raise InvalidRequest(
                f"{self.field}: expected a tensor {desc.shown()} (a map of dtype, shape, data), "
                f"got {value_kind(value)}"
            )
        if value.dtype != self._dtype:
            raise InvalidRequest(f"{self.field}.dtype: expected {self._dtype}, got {value.dtype}")
        shape = value.shape
        if len(shape) != len(desc.shape):
            raise InvalidRequest(
                f"{self.field}.shape: expected {len(desc.shape)} dimensions {desc.shown()} "
                f"(one row, no batch dimension), got {list(shape)}"
            )
        for axis, (got, want) in enumerate(zip(shape, desc.shape, strict=True)):
            if isinstance(want, int):
                if got != want:
                    raise InvalidRequest(
                        f"{self.field}.shape[{axis}]: expected {want} ({desc.shown()}), got {got}"
                    )
            elif got < 1:
                raise InvalidRequest(
                    f"{self.field}.shape[{axis}]: the free dimension {self._symbols[axis]!r} "
                    "must be >= 1"
                )
            elif self.max_length and got > self.max_length:
                raise TensorTooLarge(
                    f"{self.field}.shape[{axis}]: {got} exceeds the limit {self.max_length} on the "
                    f"free dimension {self._symbols[axis]!r} (model.inputs.{self.name}.max_length)"
                )
        return value if isinstance(value, np.ndarray) else value.to_numpy()

    def max_lengths(self) -> Mapping[str, int]:
        return {symbol: self.max_length for symbol in self._symbols.values()}

    def lengths(self, row: np.ndarray) -> Mapping[str, int]:
        return {symbol: int(row.shape[axis]) for axis, symbol in self._symbols.items()}

    def collate(
        self, rows: Sequence[Any], padded: Mapping[str, int], out: dict[str, np.ndarray]
    ) -> None:
        pad_rows(rows, self.desc, padded, self.pad_value, out)
