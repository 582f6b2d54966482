"""A TensorRT plan's tensors: what the plan and its optimization profiles say.

TensorRT 10's engine lists its named I/O tensors (``num_io_tensors``,
``get_tensor_name``, ``get_tensor_mode``, ``get_tensor_dtype``,
``get_tensor_shape``, -1 for a dynamic dimension) and, per optimization profile,
each input's (min, opt, max) shapes (``get_tensor_profile_shape``). It keeps no
names for dynamic dimensions, so ``build-engine`` writes the ONNX model's
description beside the plan (``<plan>.io.json``: the symbols that tie a
per-token output to its input's length); without it, each dynamic input
dimension gets a symbol of its own and outputs are returned at the run's
padded length. Not verified here: TensorRT cannot be installed on the machines
this project is tested on (DESIGN.md); its tests skip without it.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from worker.compute.engines.base import EngineUnavailable
from worker.flow.errors import ConfigError
from worker.model.io import Dim, ModelIO, TensorDesc

log = structlog.get_logger(__name__)


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise EngineUnavailable(
            "model.backend = 'tensorrt' needs the TensorRT Python package (tensorrt >= 10) "
            "on a machine with an NVIDIA GPU; use backend 'torch' or 'onnxruntime' otherwise"
        ) from exc
    major = int(str(tensorrt.__version__).split(".")[0])
    if major < 10:
        raise EngineUnavailable(f"TensorRT {tensorrt.__version__} found; 10 or newer is required")
    return tensorrt


def make_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that keeps the last errors (to explain a failure in the
    exception we raise) and forwards warnings and errors to structlog."""

    class _Logger(trt.ILogger):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: deque[str] = deque(maxlen=8)

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                log.error("tensorrt", message=msg)
            elif level == int(trt.ILogger.Severity.WARNING):
                log.warning("tensorrt", message=msg)

        def last_errors(self) -> str:
            return "; ".join(self.errors) or "no error logged"

    return _Logger()


def numpy_dtype(trt: Any, dtype: Any, name: str) -> np.dtype[Any]:
    try:
        result: np.dtype[Any] = np.dtype(trt.nptype(dtype))
    except TypeError as exc:
        raise ConfigError(
            f"tensor {name!r}: TensorRT type {dtype} has no NumPy equivalent"
        ) from exc
    return result


@dataclass(frozen=True)
class PlanTensors:
    """The plan's inputs and outputs (one row's shapes, symbols where known), the
    batch range every profile accepts, and each input's per-row (min, max) shapes
    over the profiles."""

    io: ModelIO
    dynamic: bool  # the batch dimension is dynamic (profiles apply)
    min_batch: int
    max_batch: int
    row_ranges: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


def describe_plan(trt: Any, engine: Any, path: Path) -> PlanTensors:
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = [n for n in names if n not in inputs]
    if not inputs:
        raise ConfigError(f"model.path: {path} has no inputs")
    sidecar = _sidecar(path)
    descs: dict[str, TensorDesc] = {}
    for name in names:
        dtype = numpy_dtype(trt, engine.get_tensor_dtype(name), name)
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        if not shape:
            raise ConfigError(f"model.path: tensor {name!r} has no batch dimension")
        known = sidecar.get(name)
        dims: list[Dim] = []
        for axis, d in enumerate(shape[1:]):
            if d >= 0:
                dims.append(d)
            elif known is not None and axis < len(known) and isinstance(known[axis], str):
                dims.append(known[axis])
            else:
                dims.append(f"{name}[{axis}]" if name in inputs else None)
        descs[name] = TensorDesc(name, dtype, tuple(dims))
    io = ModelIO(tuple(descs[n] for n in inputs), tuple(descs[n] for n in outputs))
    dynamic = any(int(engine.get_tensor_shape(n)[0]) < 0 for n in inputs)
    lo, hi = 1, 1 << 30
    ranges: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    profiles = max(1, int(engine.num_optimization_profiles))
    for name in inputs:
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        if not any(d < 0 for d in shape):
            lo, hi = max(lo, shape[0]), min(hi, shape[0])
            ranges[name] = (shape[1:], shape[1:])
            continue
        row_lo: tuple[int, ...] = ()
        row_hi: tuple[int, ...] = ()
        for profile in range(profiles):
            low, _, high = (
                tuple(int(d) for d in dims)
                for dims in engine.get_tensor_profile_shape(name, profile)
            )
            lo, hi = max(lo, low[0]), min(hi, high[0])
            row_lo = tuple(max(a, b) for a, b in zip(row_lo or low[1:], low[1:], strict=True))
            row_hi = tuple(min(a, b) for a, b in zip(row_hi or high[1:], high[1:], strict=True))
        ranges[name] = (row_lo, row_hi)
    if lo < 1 or hi < lo:
        raise ConfigError(f"model.path: {path}: unusable batch range {lo}..{hi}")
    return PlanTensors(io, dynamic, lo, hi, ranges)


def _sidecar(path: Path) -> dict[str, list[Any]]:
    """``<plan>.io.json`` (written by build-engine): tensor name -> one row's dims,
    a string naming each dynamic one."""
    side = path.with_suffix(".io.json")
    if not side.is_file():
        return {}
    try:
        data = json.loads(side.read_text())
        return {t["name"]: list(t["shape"]) for t in (*data["inputs"], *data["outputs"])}
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"model.path: {side} cannot be read: {exc}") from exc


def io_json(io: ModelIO) -> str:
    """The sidecar's text for a model description (build-engine writes it)."""

    def one(t: TensorDesc) -> dict[str, Any]:
        return {"name": t.name, "dtype": t.dtype.name, "shape": list(t.shape)}

    return json.dumps({"inputs": [one(t) for t in io.inputs],
                       "outputs": [one(t) for t in io.outputs]}, indent=2)  # fmt: skip
