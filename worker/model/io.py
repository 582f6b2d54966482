"""The model's inputs and outputs, described once, from the model file.

Every stage reads this description (Triton's model configuration, as code): the
intake checks a request's inputs against it, the batch is collated and padded by
it, and outputs are cut back to each request's own length by it. Engines fill
it from what the file declares (ONNX value infos, TensorRT bindings and
profiles, torch from the exported program or a probe); nothing else guesses.

A dimension is an ``int`` (fixed), a ``str`` (free, with the symbol the model
gives it: dimensions sharing a symbol always have the same length, which is how
a per-token output is known to follow its input's length) or ``None`` (free,
unnamed; exporters' placeholder ``'?'`` is read as unnamed too, since it names
no dimension: PaddleOCR's classifier writes it for both height and width).

Shapes here are one row's: the batch dimension is left out and its place kept
in ``batch_axis`` (0 for nearly every tensor; 1 for a recurrent state laid out
``[layers, batch, hidden]``; ``None`` for an input the whole batch shares, such
as a scalar sample rate, which cannot come per request).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from worker.flow.errors import ConfigError

Dim = int | str | None

# Symbols exporters write for "unknown": they name no dimension, so two of them
# tie nothing together.
_UNNAMED: Final = frozenset({"", "?", "-1"})


@dataclass(frozen=True)
class TensorDesc:
    """One model input or output: name, dtype, one row's shape, and where the
    batch dimension sits in the full tensor (``None``: the tensor has none)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[Dim, ...]
    batch_axis: int | None = 0

    # Cached (the description is frozen): read for every engine run.
    @functools.cached_property
    def free_axes(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.shape) if not isinstance(d, int))

    @property
    def fixed(self) -> bool:
        return not self.free_axes

    @property
    def batched(self) -> bool:
        return self.batch_axis is not None

    def symbol(self, axis: int) -> str:
        """The name a free axis is tracked by: the model's symbol, or one of its
        own for an unnamed axis (so that it matches no other axis)."""
        dim = self.shape[axis]
        if isinstance(dim, int):
            raise ValueError(f"{self.name} axis {axis} is fixed ({dim})")
        return dim if dim is not None else f"{self.name}[{axis}]"

    def symbols(self) -> tuple[str, ...]:
        return self._symbols

    @functools.cached_property
    def _symbols(self) -> tuple[str, ...]:
        return tuple(self.symbol(a) for a in self.free_axes)

    @property
    def fixed_shape(self) -> tuple[int, ...]:
        """One row's shape, every dimension fixed (a slot's buffer, an engine's
        largest row); raises for a free one."""
        if not self.fixed:
            raise ValueError(f"{self.name} has free dimensions: {self.shown()}")
        return tuple(int(d) for d in self.shape if isinstance(d, int))

    @property
    def row_elements(self) -> int:
        """Elements of one row (fixed shapes only)."""
        return math.prod(self.fixed_shape)

    @property
    def row_bytes(self) -> int:
        return self.row_elements * self.dtype.itemsize

    def row_at(self, lengths: Mapping[str, int]) -> tuple[int, ...]:
        """One row's shape in a run whose free dimensions have ``lengths`` (by
        symbol: a batch's padded lengths, a GPU's length bucket)."""
        shape = []
        for axis, d in enumerate(self.shape):
            if isinstance(d, int):
                shape.append(d)
                continue
            symbol = self.symbol(axis)
            if symbol not in lengths:
                raise ConfigError(
                    f"{self.name} {self.shown()}: free dimension {symbol!r} has no length here "
                    "(an input's max_length, or an engine profile, bounds it on a GPU)"
                )
            shape.append(lengths[symbol])
        return tuple(shape)

    def full_shape(self, batch: Dim = "batch") -> tuple[Dim, ...]:
        """The whole tensor's shape, ``batch`` at the batch axis."""
        if self.batch_axis is None:
            return self.shape
        dims = list(self.shape)
        dims.insert(self.batch_axis, batch)
        return tuple(dims)

    def shown(self) -> str:
        """``float32 [4]``, ``int64 [sequence]``, ``float32 [?, 3]``: for messages (one
        row; a tensor whose batch is not its first axis is shown whole)."""
        shape = self.shape if self.batch_axis in (0, None) else self.full_shape()
        dims = ", ".join("?" if d is None else str(d) for d in shape)
        return f"{self.dtype.name} [{dims}]"


@dataclass(frozen=True)
class ModelIO:
    """Every input and output of a model, in the file's order; ``batch``: the
    model's fixed batch size, ``None`` when the batch dimension is free."""

    inputs: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]
    batch: int | None = None

    def input(self, name: str) -> TensorDesc | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorDesc | None:
        return next((t for t in self.outputs if t.name == name), None)

    @functools.cached_property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def rebatched(self, axes: Mapping[str, tuple[int, str]]) -> ModelIO:
        """This description with the batch of each named tensor at the axis the
        configuration gives (``axes``: name -> (axis, the setting that says so)).
        The file cannot be read for it where it leaves that dimension unnamed
        (silero-vad's ``state [2, ?, 128]``); a configured axis is honoured where
        the dimension is free, and refused, naming the setting, where the file
        fixes it."""

        def moved(desc: TensorDesc) -> TensorDesc:
            if desc.name not in axes:
                return desc
            axis, setting = axes[desc.name]
            if axis == desc.batch_axis:
                return desc
            full = desc.full_shape(None)
            if axis >= len(full) or isinstance(full[axis], int):
                what = "has no such axis" if axis >= len(full) else f"fixes it at {full[axis]}"
                dims = ", ".join("?" if d is None else str(d) for d in full)
                raise ConfigError(
                    f"{setting}: {axis}, but the model file's {desc.name!r} "
                    f"({desc.dtype.name} [{dims}]) {what}: the batch dimension must be a free one"
                )
            return TensorDesc(desc.name, desc.dtype, full[:axis] + full[axis + 1 :], axis)

        return ModelIO(
            tuple(moved(d) for d in self.inputs), tuple(moved(d) for d in self.outputs), self.batch
        )


# ONNX tensor element types as onnxruntime names them ("tensor(float)").
_ONNX_TYPES: Final = {
    "float": "float32",
    "float16": "float16",
    "double": "float64",
    "uint8": "uint8",
    "int8": "int8",
    "uint16": "uint16",
    "int16": "int16",
    "uint32": "uint32",
    "int32": "int32",
    "int64": "int64",
    "uint64": "uint64",
    "bool": "bool",
}


def onnx_dtype(type_name: str, where: str) -> np.dtype[Any]:
    """``tensor(float)`` -> float32; anything else the worker cannot carry is a
    start-up error naming the tensor."""
    inner = type_name.removeprefix("tensor(").removesuffix(")")
    if inner not in _ONNX_TYPES:
        raise ConfigError(
            f"model.path: {where} has type {type_name}, which the worker cannot carry"
        )
    return np.dtype(_ONNX_TYPES[inner])


def dim(value: Any) -> Dim:
    """One dimension as a file states it: a size, a symbol, or unnamed."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.strip() not in _UNNAMED:
        return value
    return None


RawTensor = tuple[str, np.dtype[Any], tuple[Dim, ...]]
"""A tensor as the file declares it: name, dtype, whole shape (batch included)."""


def batched_io(inputs: Sequence[RawTensor], outputs: Sequence[RawTensor]) -> ModelIO:
    """Where each tensor's batch dimension is, decided once from the whole shapes.

    A model file does not say which axis is the batch; exporters put it first.
    The rules, in order:

    - a scalar has none (an input the whole batch shares: a sample rate, a flag);
    - when any input's first dimension is free, the batch is free, and its
      symbols are the named first dimensions of the inputs; a tensor whose first
      dimension is fixed but that carries one of those symbols at another axis has
      its batch there (a recurrent state ``[2, batch, 128]``); one that carries
      none has no batch dimension (it is the same for the whole batch);
    - when every input's first dimension is fixed, the model's batch is fixed
      (the most common first dimension); inputs whose first dimension differs
      have no batch dimension;
    - an output's batch is its first axis, unless that is not a batch symbol and
      another axis is.
    """
    firsts = [shape[0] for _, _, shape in inputs if shape]
    fixed = [d for d in firsts if isinstance(d, int)]
    names = frozenset(d for d in firsts if isinstance(d, str))
    batch: int | None = None
    if firsts and len(fixed) == len(firsts):
        batch = max(sorted(set(fixed)), key=fixed.count)  # the most common; ties: smallest

    def axis_of(shape: tuple[Dim, ...], output: bool) -> int | None:
        if not shape:
            return None
        first = shape[0]
        named = [i for i, d in enumerate(shape) if isinstance(d, str) and d in names]
        if first in names or (not isinstance(first, int) and not named):
            return 0
        if named:
            return named[0]
        if batch is not None:
            return 0 if first == batch or output else None
        return 0 if output else None

    def described(raw: RawTensor, output: bool) -> TensorDesc:
        name, dtype, shape = raw
        axis = axis_of(shape, output)
        row = shape if axis is None else shape[:axis] + shape[axis + 1 :]
        return TensorDesc(name, dtype, row, axis)

    return ModelIO(
        tuple(described(t, False) for t in inputs),
        tuple(described(t, True) for t in outputs),
        batch,
    )


def unbatched_io(inputs: Sequence[RawTensor], outputs: Sequence[RawTensor]) -> ModelIO:
    """``model.unbatched``: a model file with no batch axis at all (a recurrent
    model of input ``[seq_len, 576]`` and state ``[1, 1, 128]``): one request per
    run, each input and output whole. The worker sees a batch of one on a
    virtual first axis (the engine drops it before the run and adds it after),
    so every row is the file's tensor as it is; a scalar stays shared."""

    def described(raw: RawTensor) -> TensorDesc:
        name, dtype, shape = raw
        return TensorDesc(name, dtype, shape, 0 if shape else None)

    return ModelIO(
        tuple(described(t) for t in inputs), tuple(described(t) for t in outputs), batch=1
    )


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
