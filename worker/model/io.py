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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
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

    @property
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
        return tuple(self.symbol(a) for a in self.free_axes)

    @property
    def row_elements(self) -> int:
        """Elements of one row (fixed shapes only)."""
        if not self.fixed:
            raise ValueError(f"{self.name} has free dimensions: {self.shown()}")
        return math.prod(int(d) for d in self.shape if isinstance(d, int))

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

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


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


# --- which outputs a result carries ------------------------------------------------


@dataclass(frozen=True)
class OutputSelection:
    """Which model outputs a result carries, decided once from the settings:
    ``raw`` is ``model.output`` (what postprocessing reads; default the first
    output with a batch dimension), ``passed`` come back as computed, and with
    postprocessing on, ``raw``'s computed forms replace it (``worker.compute.
    outputs``). An output without a batch dimension (one value for the whole
    batch) cannot be a request's answer: left out by default, refused by name."""

    raw: str
    passed: tuple[str, ...]
    postprocessed: bool  # raw is replaced by its computed forms

    @property
    def returned(self) -> tuple[str, ...]:
        """Every model output whose rows a result carries (its shape matters)."""
        if self.postprocessed:
            return tuple(dict.fromkeys((*self.passed, self.raw)))
        return self.passed


def select_outputs(
    io: ModelIO, output: str | None, outputs: Sequence[str], postprocessed: bool
) -> OutputSelection:
    """``output`` / ``outputs``: ``model.output`` and ``model.outputs``;
    ``postprocessed``: the resolved postprocessing replaces ``model.output``."""
    names = io.output_names
    if not names:
        raise ConfigError("model.path: the model declares no outputs")
    batched = tuple(t.name for t in io.outputs if t.batched)
    raw = output or (batched[0] if batched else names[0])
    if raw not in names:
        raise ConfigError(f"model.output: {raw!r} not in model outputs {list(names)}")
    for name in outputs:
        if name not in names:
            raise ConfigError(f"model.outputs: {name!r} not in model outputs {list(names)}")
    passed = tuple(outputs) if postprocessed or outputs else batched
    selection = OutputSelection(raw, passed, postprocessed)
    for name in selection.returned:
        desc = io.output(name)
        if desc is not None and not desc.batched:
            setting = "model.output" if name == raw and name not in passed else "model.outputs"
            raise ConfigError(
                f"{setting}: the output {name!r} ({desc.shown()}) has no batch dimension: it "
                "is one value for the whole batch, not a row per request; leave it out"
            )
    return selection


# --- models shipped in the package ----------------------------------------------------


@dataclass(frozen=True)
class Builtin:
    """A model in ``worker/models``; ``tokenizer`` for the text models."""

    file: str
    tokenizer: str | None = None
    max_length: int = 128  # its text input's truncation, when it has one


BUILTIN_MODELS: Final = {
    "digits": Builtin("digits.onnx"),
    "sentiment": Builtin("sentiment.onnx", tokenizer="sentiment.tokenizer.json", max_length=64),
}


def _builtin_file(name: str) -> Path:
    return Path(str(resources.files("worker") / "models" / name))


def resolve_model_path(path: str) -> Path:
    """``builtin:NAME`` names a model shipped in the package; anything else is a file."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            known = ", ".join(sorted(BUILTIN_MODELS))
            raise ConfigError(f"model.path: unknown builtin model {name!r} (builtin: {known})")
        return _builtin_file(BUILTIN_MODELS[name].file)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.path: {path} is not a file")
    return p


def resolve_tokenizer_path(path: str, setting: str) -> Path:
    """A tokenizer.json file, or ``builtin:NAME`` for a bundled text model's."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        builtin = BUILTIN_MODELS.get(name)
        if builtin is None or builtin.tokenizer is None:
            known = ", ".join(sorted(n for n, b in BUILTIN_MODELS.items() if b.tokenizer))
            raise ConfigError(f"{setting}: no builtin tokenizer {name!r} (builtin: {known})")
        return _builtin_file(builtin.tokenizer)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{setting}: {path} is not a file")
    return p
