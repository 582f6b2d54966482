"""Tensors as they travel: ``{"dtype", "shape", "data"}`` with little-endian C-order bytes.

Tensors stay as ``(dtype, shape, bytes)``: decoding never copies pixel data a
second time, and ``Tensor.to_numpy`` is a zero-copy, read-only view.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Final

import numpy as np

from worker.contract.limits import Limits
from worker.contract.wire import TENSOR_FIELDS, kind, short_name
from worker.flow.errors import InvalidRequest, TensorTooLarge
from worker.flow.values import DTYPE_LIST, FLOAT_DTYPES, WIRE_DTYPES, Tensor, is_int


def decode_tensor(raw: object, path: str, limits: Limits) -> Tensor:
    if not isinstance(raw, dict):
        raise InvalidRequest(
            f"{path}: expected a tensor map {{dtype, shape, data}} or an image file (bin), "
            f"got {kind(raw)}"
        )
    for key in TENSOR_FIELDS:
        if key not in raw:
            raise InvalidRequest(f"{path}.{key}: missing")
    unknown = [k for k in raw if k not in TENSOR_FIELDS]
    if unknown:
        raise InvalidRequest(
            f"{path}.{short_name(unknown[0])}: unknown field; a tensor has dtype, shape, data"
        )
    return tensor_from_fields(raw["dtype"], raw["shape"], raw["data"], path, limits)


def tensor_from_fields(
    dtype: Any, shape: Any, data: Any, path: str, limits: Limits, typed: bool = False
) -> Tensor:
    """A tensor's three fields checked, in the contract's order: the one set of
    tensor rules, for a map ``decode_tensor`` unpacked and for the typed
    decoder's fields (``worker.contract.requests``). ``typed``: the fields'
    types already hold (a str, a list of ints >= 0, bytes: the typed decoder
    checked them in C), so only their values are checked here."""
    if not typed and not isinstance(dtype, str):
        raise InvalidRequest(f"{path}.dtype: expected str, got {kind(dtype)}")
    wire_dtype = WIRE_DTYPES.get(dtype)
    if wire_dtype is None:
        raise InvalidRequest(
            f"{path}.dtype: unsupported {short_name(dtype)!r}; supported: {DTYPE_LIST}"
        )

    if not typed and not isinstance(shape, list):
        raise InvalidRequest(f"{path}.shape: expected a list of ints, got {kind(shape)}")
    if not 1 <= len(shape) <= limits.max_rank:
        raise InvalidRequest(f"{path}.shape: rank must be 1 to {limits.max_rank}, got {len(shape)}")
    if not typed:
        for i, dim in enumerate(shape):
            if not is_int(dim):
                raise InvalidRequest(f"{path}.shape[{i}]: expected int, got {kind(dim)}")
            if dim < 0:
                raise InvalidRequest(f"{path}.shape[{i}]: must be >= 0, got {dim}")

    # Python ints: a shape of four 2**64-1 dims is an error, not an overflow.
    nbytes = math.prod(shape) * wire_dtype.itemsize
    if nbytes > limits.max_tensor_bytes:
        raise TensorTooLarge(
            f"{path}: {dtype} {shape} is {nbytes} bytes; the limit is {limits.max_tensor_bytes}"
        )

    if not typed and not isinstance(data, bytes):
        raise InvalidRequest(f"{path}.data: expected msgpack bin, got {kind(data)}")
    if len(data) != nbytes:
        raise InvalidRequest(f"{path}.data: {dtype} {shape} needs {nbytes} bytes, got {len(data)}")

    if dtype in FLOAT_DTYPES:
        # NaN/Inf poison a whole batch on the GPU (softmax, normalisation), so
        # they are refused here, per request, where the client can be told.
        if not _all_finite(data, dtype, wire_dtype):
            raise InvalidRequest(f"{path}.data: non-finite values (NaN or Inf)")
    elif dtype == "bool" and data.translate(None, b"\x00\x01"):
        # numpy's bool is a byte that must be 0 or 1; other values give
        # results that differ between numpy, CuPy and engines.
        raise InvalidRequest(f"{path}.data: bool values must be 0 or 1")

    return _checked(dtype, tuple(shape), data)


# Few float32/float64 values (features, scores) are checked in Python: a sum is
# finite only if every value is (NaN and Inf carry through a sum), 0.4 us for
# four values against 2.1 us for numpy's isfinite. A sum that is not finite may
# only have overflowed, so numpy decides then; and for longer data.
# (Native byte order: wire bytes are little-endian.)
_SUMMED: Final = {"float32": "f", "float64": "d"} if sys.byteorder == "little" else {}
_SUMMED_AT_MOST: Final = 64  # values


def _all_finite(data: bytes, dtype: str, wire_dtype: np.dtype[Any]) -> bool:
    fmt = _SUMMED.get(dtype)
    if fmt is not None and len(data) <= _SUMMED_AT_MOST * wire_dtype.itemsize:
        values: memoryview[float] = memoryview(data).cast(fmt)  # type: ignore[call-overload]
        if math.isfinite(sum(values)):
            return True
    return bool(np.isfinite(np.frombuffer(data, dtype=wire_dtype)).all())


def _checked(dtype: str, shape: tuple[int, ...], data: bytes) -> Tensor:
    """A ``Tensor`` from fields ``decode_tensor`` has just checked, exactly as
    ``__post_init__`` does, without checking them a second time (per record, on
    the consume path)."""
    tensor = object.__new__(Tensor)
    _set_dtype(tensor, dtype)
    _set_shape(tensor, shape)
    _set_data(tensor, data)
    return tensor


# The slots' setters, bypassing the frozen dataclass's __setattr__ (0.36
# against 0.61 us a tensor with ``object.__setattr__``).
_set_dtype = vars(Tensor)["dtype"].__set__
_set_shape = vars(Tensor)["shape"].__set__
_set_data = vars(Tensor)["data"].__set__
