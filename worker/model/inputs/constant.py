"""``kind = "constant"``: the same value fed to a model input every run.

Not a request input: requests never carry it (one that does is told so). It is
how a model input the whole batch shares is served (a scalar sample rate, a
flag, a threshold: an input without a batch dimension), and how a batched input
that never changes is kept out of every request (its ``value`` is one row,
repeated per row). The value is converted to the model input's dtype and shape
once, at start-up; a value that does not fit stops start-up naming the setting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker.config.model import ConstantInput
from worker.flow.errors import ConfigError
from worker.model.inputs.base import WorkerSetInput
from worker.model.io import TensorDesc
from worker.model.shapes import dense


class BoundConstant(WorkerSetInput):
    kind = "constant"

    def __init__(self, name: str, cfg: ConstantInput, feed: TensorDesc, setting: str) -> None:
        super().__init__(name, (feed,))
        self.desc = feed
        self.value = _converted(cfg.value, feed, f"{setting}.value")
        self.set_by = (
            f"set by the worker (model.inputs.{name}.value), not per request; leave it out"
        )

    def collate(
        self, rows: Sequence[Any], padded: Mapping[str, int], out: dict[str, np.ndarray]
    ) -> None:
        """The value once (no batch dimension), else one row per request at the
        input's batch axis."""
        if self.desc.batch_axis is None:
            out[self.desc.name] = self.value
            return
        n = len(rows)
        if self.desc.batch_axis == 0:
            buffer = out.get(self.desc.name)  # a GPU slot's pinned twin, if any
            view = (
                np.empty((n, *self.value.shape), self.desc.dtype)
                if buffer is None
                else dense(buffer, n, self.value.shape)
            )
            view[...] = self.value
            out[self.desc.name] = view
            return
        row = np.expand_dims(self.value, self.desc.batch_axis)
        shape = list(row.shape)
        shape[self.desc.batch_axis] = n
        out[self.desc.name] = np.ascontiguousarray(np.broadcast_to(row, tuple(shape)))

    def describe(self) -> str:
        shown = self.value.tolist() if self.value.size <= 8 else f"{self.value.size} values"
        return f"{self.name} (constant {shown} -> {self.desc.name} {self.desc.shown()})"


def _converted(value: object, desc: TensorDesc, setting: str) -> np.ndarray:
    """``value`` as ``desc``'s dtype and row shape (a single number fills a fixed
    shape); refused when it does not fit, naming ``setting``."""
    try:
        given = np.asarray(value)
        array = given.astype(desc.dtype)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{setting}: {value!r} is not {desc.dtype.name}: {exc}") from exc
    if given.dtype.kind == "f" and desc.dtype.kind in "iub" and not np.array_equal(array, given):
        raise ConfigError(f"{setting}: {value!r} does not fit the {desc.dtype.name} input "
                          f"{desc.name!r} without rounding")  # fmt: skip
    if array.ndim == 0 and desc.fixed and desc.shape:
        array = np.full(tuple(int(d) for d in desc.shape if isinstance(d, int)), array)
    fits = array.ndim == len(desc.shape) and all(
        not isinstance(d, int) or d == got for d, got in zip(desc.shape, array.shape, strict=True)
    )
    if not fits:
        raise ConfigError(
            f"{setting}: a value of shape {list(array.shape)} does not fit the model input "
            f"{desc.name!r} ({desc.shown()}{'' if desc.batched else ', no batch dimension'})"
        )
    array.setflags(write=False)
    return array
