"""The model's inputs and outputs, described once, from the model file.

Every stage reads this description (Triton's model configuration, as code): the
intake checks a request's inputs against it, the batch is collated and padded by
it, and outputs are cut back to each request's own length by it. Engines fill
it from what the file declares (ONNX value infos, TensorRT bindings and
profiles, torch from the exported program or a probe); nothing else guesses.

A dimension is an ``int`` (fixed), a ``str`` (free, with the symbol the model
gives it: dimensions sharing a symbol always have the same length, which is how
a per-token output is known to follow its input's length) or ``None`` (free,
unnamed). Shapes here are one row's: the batch dimension is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

import numpy as np

from worker.errors import ConfigError

Dim = int | str | None


@dataclass(frozen=True)
class TensorDesc:
    """One model input or output: name, dtype, and one row's shape."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[Dim, ...]

    @property
    def free_axes(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.shape) if not isinstance(d, int))

    @property
    def fixed(self) -> bool:
        return not self.free_axes

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

    def shown(self) -> str:
        """``float32 [4]``, ``int64 [sequence]``, ``float32 [?, 3]``: for messages."""
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype.name} [{dims}]"


@dataclass(frozen=True)
class ModelIO:
    """Every input and output of a model, in the file's order."""

    inputs: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]

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


def onnx_desc(name: str, type_name: str, shape: list[Any], where: str) -> tuple[Dim, TensorDesc]:
    """A desc from onnxruntime's ``NodeArg`` fields; returns the batch dimension
    too (an ``int`` when the model fixes it)."""
    if not shape:
        raise ConfigError(
            f"model.path: {where} {name!r} is a scalar; every tensor needs a batch dimension"
        )
    dims: list[Dim] = []
    for d in shape:
        if (isinstance(d, int) and d >= 0) or (isinstance(d, str) and d):
            dims.append(d)
        else:
            dims.append(None)
    return dims[0], TensorDesc(name, onnx_dtype(type_name, f"{where} {name!r}"), tuple(dims[1:]))


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
