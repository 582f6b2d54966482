"""msgpack <-> typed requests and results: the wire contract, version 1.

The contract is public (schemas/README.md, schemas/*.json) and clients in any
language write to it, so this module is the one place that decides what a
record means. Everything that arrives is hostile until proven otherwise:

* the record's size is checked before msgpack sees a byte, and msgpack itself
  runs with length limits, no ext types and a bounded nesting depth, so a
  small record cannot make the worker allocate a large one;
* a record that is not a msgpack map cannot be answered (there is no id), so
  it becomes ``UndecodableRecord`` and goes to the DLQ with its bytes intact;
* a map that breaks the contract becomes ``InvalidRequest`` carrying whatever
  id and meta could be recovered, so the client gets an error result it can
  correlate; every message names the offending field.

Tensors stay as ``(dtype, shape, bytes)``: decoding never copies pixel data a
second time, and ``Tensor.to_numpy`` is a zero-copy, read-only view. No pickle
and no msgpack ext types, ever: both would let a record choose what code runs
or what objects get built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import msgpack
import numpy as np
import numpy.typing as npt

from worker.errors import (
    InvalidRequest,
    RecordTooLarge,
    TensorTooLarge,
    UndecodableRecord,
    WorkerError,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPES",
    "ERROR_CODES",
    "SUPPORTED_VERSIONS",
    "ErrorInfo",
    "Limits",
    "ModelInfo",
    "Request",
    "Result",
    "Source",
    "Tensor",
    "decode_request",
    "decode_result",
    "encode_request",
    "encode_result",
]

SUPPORTED_VERSIONS: Final = (1,)

DTYPES: Final = frozenset(
    {
        "uint8",
        "int8",
        "uint16",
        "int16",
        "uint32",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "bool",
    }
)

#: Every code a result's ``error.code`` or a DLQ record's ``error.code`` header may
#: carry. One vocabulary for both, so clients and operators read the same words.
ERROR_CODES: Final = frozenset(
    {
        "invalid_request",
        "deadline_exceeded",
        "inference_failed",
        "too_large",
        "undecodable",
        "internal",
    }
)

# The wire is little-endian whatever the host is; pinning the byte order here
# means to_numpy/from_numpy are correct on big-endian hosts too.
_WIRE_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    name: np.dtype(name).newbyteorder("<") for name in DTYPES
}
_FLOAT_DTYPES: Final = frozenset({"float16", "float32", "float64"})
_DTYPE_LIST: Final = ", ".join(sorted(DTYPES))

_REQUEST_FIELDS: Final = ("v", "id", "inputs", "deadline_ms", "meta")
_TENSOR_FIELDS: Final = ("dtype", "shape", "data")
_RESULT_FIELDS: Final = (
    "v",
    "id",
    "status",
    "outputs",
    "error",
    "model",
    "source",
    "timing_us",
    "meta",
)

# Error messages end up in results and Kafka headers; a client-chosen name or
# an exception's text must not make them unbounded.
_MAX_NAME_IN_MESSAGE: Final = 64
_MAX_ERROR_MESSAGE_CHARS: Final = 1024


def _is_int(x: object) -> bool:
    """True for ints that are not bools: ``True`` is an ``int`` in Python, and
    ``{"v": true}`` must not pass as version 1."""
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor as it travels: dtype name, shape, little-endian C-order bytes.

    Construction checks that the bytes fit the shape, so every ``Tensor`` in the
    process can be viewed with ``to_numpy`` without further checks.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        # A list shape would make the tensor unhashable and unequal to its own
        # decoded copy; tuple() of a tuple is the same object, so this is free.
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unsupported {self.dtype!r}; supported: {_DTYPE_LIST}")
        if not all(_is_int(d) and d >= 0 for d in self.shape):
            raise ValueError(f"shape: expected non-negative ints, got {self.shape!r}")
        expected = math.prod(self.shape) * _WIRE_DTYPES[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(
                f"data: {self.dtype} {list(self.shape)} needs {expected} bytes, "
                f"got {len(self.data)}"
            )

    @classmethod
    def from_numpy(cls, arr: npt.NDArray[Any]) -> Tensor:
        """Copy ``arr`` once into wire form (C order, little-endian)."""
        a = np.asarray(arr)
        name = a.dtype.name
        if name not in DTYPES:
            raise ValueError(f"dtype: unsupported {name!r}; supported: {_DTYPE_LIST}")
        data = a.astype(_WIRE_DTYPES[name], copy=False).tobytes(order="C")
        return cls(name, tuple(int(d) for d in a.shape), data)

    def to_numpy(self) -> npt.NDArray[Any]:
        """A read-only view over ``data``: no copy, so decoding a 4 MiB image
        costs nothing more than msgpack's own copy out of the record."""
        return np.frombuffer(self.data, dtype=_WIRE_DTYPES[self.dtype]).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limits:
    """Bounds on what one record may make the worker do.

    ``max_record_bytes`` is checked before decoding; the msgpack ``max_*_len``
    limits during it; the rest after, when a violation can still be answered
    with an error result. Tensor bytes are bounded by ``max_tensor_bytes`` after
    decoding rather than by msgpack's ``max_bin_len``, so an oversized image
    gets a ``too_large`` reply instead of vanishing into the DLQ; msgpack's
    bins are still bounded by the record size, which is already in memory.
    """

    max_record_bytes: int = 8 * 1024 * 1024
    max_tensor_bytes: int = 4 * 1024 * 1024
    max_inputs: int = 8
    max_rank: int = 4
    max_id_chars: int = 256
    max_meta_bytes: int = 4096
    max_map_len: int = 64
    max_array_len: int = 64
    max_str_len: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "max_record_bytes",
            "max_tensor_bytes",
            "max_inputs",
            "max_rank",
            "max_id_chars",
            "max_meta_bytes",
            "max_map_len",
            "max_array_len",
            "max_str_len",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"limits.{name}: expected an int >= 1, got {value!r}")
        # The request's own top-level map and its inputs map are read under
        # max_map_len; a smaller value would turn valid requests into DLQ records.
        if self.max_map_len < max(len(_REQUEST_FIELDS), self.max_inputs):
            raise ValueError(
                f"limits.max_map_len: must be >= max_inputs ({self.max_inputs}) "
                f"and >= {len(_REQUEST_FIELDS)}, got {self.max_map_len}"
            )
        if self.max_array_len < self.max_rank:
            raise ValueError(
                f"limits.max_array_len: must be >= max_rank ({self.max_rank}), "
                f"got {self.max_array_len}"
            )


DEFAULT_LIMITS: Final = Limits()


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Request:
    """A validated request. ``inputs`` are checked against the limits it was
    decoded with; ``meta`` is echoed back untouched."""

    v: int
    id: str
    inputs: Mapping[str, Tensor]
    deadline_ms: int | None = None
    meta: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ErrorInfo:
    """The ``error`` field of a result; ``code`` is one of ``ERROR_CODES``."""

    code: str
    message: str

    def __post_init__(self) -> None:
        if self.code not in ERROR_CODES:
            raise ValueError(
                f"error.code: {self.code!r} is not in the contract; "
                f"expected one of {', '.join(sorted(ERROR_CODES))}"
            )

    @classmethod
    def from_error(cls, err: BaseException) -> ErrorInfo:
        """Map any exception onto the contract's vocabulary.

        Worker errors whose code the contract knows keep it and their message;
        anything else becomes ``internal`` and names only the exception type,
        so internal details (paths, device state) do not leak to clients.
        """
        if isinstance(err, WorkerError) and err.code in ERROR_CODES:
            message = str(err) or type(err).__name__
            return cls(err.code, message[:_MAX_ERROR_MESSAGE_CHARS])
        return cls("internal", f"internal error ({type(err).__name__})")


@dataclass(frozen=True)
class Source:
    """Where the request came from: the idempotency key of its result."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class ModelInfo:
    """``version`` is the content hash of the model file, so results from
    different builds of the same model are distinguishable."""

    name: str
    version: str


@dataclass(frozen=True)
class Result:
    """One answer per request. ``error`` is set exactly when status is "error"."""

    id: str
    status: Literal["ok", "error"]
    source: Source
    model: ModelInfo
    outputs: Mapping[str, Tensor] = field(default_factory=dict)
    error: ErrorInfo | None = None
    meta: Mapping[str, Any] | None = None
    timing_us: Mapping[str, int] = field(default_factory=dict)
    v: int = 1

    def __post_init__(self) -> None:
        if self.status not in ("ok", "error"):
            raise ValueError(f"status: expected 'ok' or 'error', got {self.status!r}")
        if (self.status == "error") != (self.error is not None):
            raise ValueError(
                f"error: must be set exactly when status is 'error' "
                f"(status={self.status!r}, error={self.error!r})"
            )


# --------------------------------------------------------------------------- requests


def decode_request(value: bytes | None, limits: Limits = DEFAULT_LIMITS) -> Request:
    """Decode and validate one input record's value.

    Raises ``RecordTooLarge`` / ``UndecodableRecord`` when the record cannot be
    answered (it goes to the DLQ), ``InvalidRequest`` / ``TensorTooLarge`` when
    it can (the exception carries the recovered id and meta for the reply).
    """
    if not value:
        raise UndecodableRecord("record value is empty")
    if len(value) > limits.max_record_bytes:
        raise RecordTooLarge(
            f"record is {len(value)} bytes; the limit is {limits.max_record_bytes}"
        )
    obj = _unpack_map(
        value,
        max_bin_len=limits.max_record_bytes,
        max_str_len=limits.max_str_len,
        max_array_len=limits.max_array_len,
        max_map_len=limits.max_map_len,
    )
    # Recover what the error reply needs before judging anything else, so every
    # contract violation below can still be correlated by the client.
    id_problem = _id_problem(obj.get("id", _MISSING), limits)
    meta_problem = _meta_problem(obj["meta"], limits) if "meta" in obj else None
    request_id: str = obj["id"] if id_problem is None else ""
    meta: dict[str, Any] | None = obj.get("meta") if meta_problem is None else None
    try:
        _check_version_and_fields(obj)
        if id_problem is not None:
            raise InvalidRequest(id_problem)
        deadline_ms = _decode_deadline(obj)
        if meta_problem is not None:
            raise InvalidRequest(meta_problem)
        inputs = _decode_inputs(obj, limits)
    except InvalidRequest as exc:
        exc.request_id = request_id
        exc.meta = meta
        raise
    return Request(v=obj["v"], id=request_id, inputs=inputs, deadline_ms=deadline_ms, meta=meta)


def encode_request(req: Request) -> bytes:
    """The client side of the contract; used by tests, the demo and benchmarks."""
    wire: dict[str, Any] = {
        "v": req.v,
        "id": req.id,
        "inputs": {name: t.to_wire() for name, t in req.inputs.items()},
    }
    if req.deadline_ms is not None:
        wire["deadline_ms"] = int(req.deadline_ms)
    if req.meta is not None:
        wire["meta"] = dict(req.meta)
    return _pack(wire)


def _check_version_and_fields(obj: dict[str, Any]) -> None:
    # Version first: a v2 request is best answered "unsupported version", not
    # with complaints about fields v1 does not know.
    if "v" not in obj:
        raise InvalidRequest(f"v: missing; supported versions: {_versions()}")
    v = obj["v"]
    if not _is_int(v):
        raise InvalidRequest(f"v: expected int, got {_kind(v)}")
    if v not in SUPPORTED_VERSIONS:
        raise InvalidRequest(f"v: unsupported version {v}; supported versions: {_versions()}")
    # Unknown keys are rejected rather than ignored: a misspelt "deadline" that
    # silently does nothing is worse than an error the client sees at once.
    for key in obj:
        if key not in _REQUEST_FIELDS:
            raise InvalidRequest(
                f"{_name(key)}: unknown field; request v1 has {', '.join(_REQUEST_FIELDS)}"
            )


def _decode_deadline(obj: dict[str, Any]) -> int | None:
    if "deadline_ms" not in obj:
        return None
    d = obj["deadline_ms"]
    if not _is_int(d):
        raise InvalidRequest(
            f"deadline_ms: expected int (absolute epoch ms), got {_kind(d)}; "
            "omit the field for no deadline"
        )
    if d < 0:
        raise InvalidRequest(f"deadline_ms: must be >= 0, got {d}")
    return int(d)


def _decode_inputs(obj: dict[str, Any], limits: Limits) -> dict[str, Tensor]:
    if "inputs" not in obj:
        raise InvalidRequest("inputs: missing")
    raw_inputs = obj["inputs"]
    if not isinstance(raw_inputs, dict):
        raise InvalidRequest(f"inputs: expected a map of name -> tensor, got {_kind(raw_inputs)}")
    if not 1 <= len(raw_inputs) <= limits.max_inputs:
        raise InvalidRequest(
            f"inputs: expected 1 to {limits.max_inputs} tensors, got {len(raw_inputs)}"
        )
    inputs: dict[str, Tensor] = {}
    for name, raw in raw_inputs.items():
        if not isinstance(name, str):
            raise InvalidRequest(f"inputs: tensor names must be str, got {_kind(name)}")
        inputs[name] = _decode_tensor(raw, f"inputs.{_name(name)}", limits)
    return inputs


def _decode_tensor(raw: object, path: str, limits: Limits) -> Tensor:
    if not isinstance(raw, dict):
        raise InvalidRequest(
            f"{path}: expected a tensor map {{dtype, shape, data}}, got {_kind(raw)}"
        )
    for key in _TENSOR_FIELDS:
        if key not in raw:
            raise InvalidRequest(f"{path}.{key}: missing")
    unknown = [k for k in raw if k not in _TENSOR_FIELDS]
    if unknown:
        raise InvalidRequest(
            f"{path}.{_name(unknown[0])}: unknown field; a tensor has dtype, shape, data"
        )

    dtype = raw["dtype"]
    if not isinstance(dtype, str):
        raise InvalidRequest(f"{path}.dtype: expected str, got {_kind(dtype)}")
    if dtype not in DTYPES:
        raise InvalidRequest(
            f"{path}.dtype: unsupported {_name(dtype)!r}; supported: {_DTYPE_LIST}"
        )

    shape = raw["shape"]
    if not isinstance(shape, list):
        raise InvalidRequest(f"{path}.shape: expected a list of ints, got {_kind(shape)}")
    if not 1 <= len(shape) <= limits.max_rank:
        raise InvalidRequest(f"{path}.shape: rank must be 1 to {limits.max_rank}, got {len(shape)}")
    for i, dim in enumerate(shape):
        if not _is_int(dim):
            raise InvalidRequest(f"{path}.shape[{i}]: expected int, got {_kind(dim)}")
        if dim < 0:
            raise InvalidRequest(f"{path}.shape[{i}]: must be >= 0, got {dim}")

    wire_dtype = _WIRE_DTYPES[dtype]
    # Python ints: a shape of four 2**64-1 dims is an error, not an overflow.
    nbytes = math.prod(shape) * wire_dtype.itemsize
    if nbytes > limits.max_tensor_bytes:
        raise TensorTooLarge(
            f"{path}: {dtype} {shape} is {nbytes} bytes; the limit is {limits.max_tensor_bytes}"
        )

    data = raw["data"]
    if not isinstance(data, bytes):
        raise InvalidRequest(f"{path}.data: expected msgpack bin, got {_kind(data)}")
    if len(data) != nbytes:
        raise InvalidRequest(f"{path}.data: {dtype} {shape} needs {nbytes} bytes, got {len(data)}")

    if dtype in _FLOAT_DTYPES:
        # NaN/Inf poison a whole batch on the GPU (softmax, normalisation), so
        # they are refused here, per request, where the client can be told.
        if not np.isfinite(np.frombuffer(data, dtype=wire_dtype)).all():
            raise InvalidRequest(f"{path}.data: non-finite values (NaN or Inf)")
    elif dtype == "bool" and data.translate(None, b"\x00\x01"):
        # numpy's bool is a byte that must be 0 or 1; other values give
        # results that differ between numpy, CuPy and engines.
        raise InvalidRequest(f"{path}.data: bool values must be 0 or 1")

    return Tensor(dtype, tuple(shape), data)


def _id_problem(raw: object, limits: Limits) -> str | None:
    """Why ``raw`` is not a usable id, or None when it is."""
    if raw is _MISSING:
        return "id: missing"
    if not isinstance(raw, str):
        return f"id: expected str, got {_kind(raw)}"
    if not 1 <= len(raw) <= limits.max_id_chars:
        return f"id: length must be 1 to {limits.max_id_chars}, got {len(raw)}"
    return None


def _meta_problem(raw: object, limits: Limits) -> str | None:
    """Why ``raw`` cannot be echoed as meta, or None when it can."""
    if not isinstance(raw, dict):
        return f"meta: expected a map, got {_kind(raw)}"
    for key in raw:
        if not isinstance(key, str):
            return f"meta: keys must be str, got {_kind(key)}"
    # The echo costs what its re-encoding costs, so that is what is limited.
    try:
        size = len(_pack(raw))
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        return f"meta: cannot be re-encoded ({exc})"
    if size > limits.max_meta_bytes:
        return f"meta: {size} bytes when encoded; the limit is {limits.max_meta_bytes}"
    return None


# --------------------------------------------------------------------------- results


def encode_result(res: Result) -> bytes:
    """Encode a result with exactly the contract's fields (``error`` and
    ``meta`` only when set). Integers are coerced with ``int()`` so numpy
    scalars from timing or offsets cannot make msgpack fail on the hot path."""
    wire: dict[str, Any] = {
        "v": res.v,
        "id": res.id,
        "status": res.status,
        "outputs": {name: t.to_wire() for name, t in res.outputs.items()},
    }
    if res.error is not None:
        wire["error"] = {"code": res.error.code, "message": res.error.message}
    wire["model"] = {"name": res.model.name, "version": res.model.version}
    wire["source"] = {
        "topic": res.source.topic,
        "partition": int(res.source.partition),
        "offset": int(res.source.offset),
    }
    wire["timing_us"] = {k: int(v) for k, v in res.timing_us.items()}
    if res.meta is not None:
        wire["meta"] = dict(res.meta)
    return _pack(wire)


def decode_result(value: bytes) -> Result:
    """Decode a result: for clients, tests and the demo.

    Bytes that are not a msgpack map raise ``UndecodableRecord``; a map that
    breaks the contract raises ``ValueError`` naming the field. Results come
    from the worker, so limits are msgpack's defaults (nothing may claim more
    than the buffer holds) rather than ``Limits``.
    """
    if not value:
        raise UndecodableRecord("record value is empty")
    obj = _unpack_map(value)

    for key in obj:
        if key not in _RESULT_FIELDS:
            raise ValueError(
                f"{_name(key)}: unknown field; result v1 has {', '.join(_RESULT_FIELDS)}"
            )
    for key in ("v", "id", "status", "outputs", "model", "source", "timing_us"):
        if key not in obj:
            raise ValueError(f"{key}: missing")

    v = obj["v"]
    if not _is_int(v) or v not in SUPPORTED_VERSIONS:
        raise ValueError(f"v: unsupported version {v!r}; supported versions: {_versions()}")
    rid = _expect(obj["id"], str, "id")
    status = obj["status"]
    if status not in ("ok", "error"):
        raise ValueError(f"status: expected 'ok' or 'error', got {status!r}")

    outputs: dict[str, Tensor] = {}
    for name, raw in _expect(obj["outputs"], dict, "outputs").items():
        path = f"outputs.{_name(name)}"
        if not isinstance(name, str):
            raise ValueError(f"outputs: names must be str, got {_kind(name)}")
        t = _expect(raw, dict, path)
        if set(t) != set(_TENSOR_FIELDS):
            raise ValueError(
                f"{path}: expected exactly dtype, shape, data; got {sorted(map(str, t))}"
            )
        shape = _expect(t["shape"], list, f"{path}.shape")
        try:
            outputs[name] = Tensor(
                _expect(t["dtype"], str, f"{path}.dtype"),
                tuple(shape),
                _expect(t["data"], bytes, f"{path}.data"),
            )
        except ValueError as exc:
            raise ValueError(f"{path}.{exc}") from None

    error: ErrorInfo | None = None
    if "error" in obj:
        e = _expect(obj["error"], dict, "error")
        if set(e) != {"code", "message"}:
            raise ValueError(f"error: expected exactly code, message; got {sorted(map(str, e))}")
        error = ErrorInfo(
            _expect(e["code"], str, "error.code"), _expect(e["message"], str, "error.message")
        )

    m = _expect(obj["model"], dict, "model")
    if set(m) != {"name", "version"}:
        raise ValueError(f"model: expected exactly name, version; got {sorted(map(str, m))}")
    model = ModelInfo(
        _expect(m["name"], str, "model.name"), _expect(m["version"], str, "model.version")
    )

    s = _expect(obj["source"], dict, "source")
    if set(s) != {"topic", "partition", "offset"}:
        raise ValueError(
            f"source: expected exactly topic, partition, offset; got {sorted(map(str, s))}"
        )
    source = Source(
        _expect(s["topic"], str, "source.topic"),
        _expect_count(s["partition"], "source.partition"),
        _expect_count(s["offset"], "source.offset"),
    )

    timing: dict[str, int] = {}
    for k, t_us in _expect(obj["timing_us"], dict, "timing_us").items():
        if not isinstance(k, str):
            raise ValueError(f"timing_us: keys must be str, got {_kind(k)}")
        timing[k] = _expect_count(t_us, f"timing_us.{_name(k)}")

    meta: dict[str, Any] | None = None
    if "meta" in obj:
        meta = _expect(obj["meta"], dict, "meta")

    return Result(
        id=rid,
        status=status,
        source=source,
        model=model,
        outputs=outputs,
        error=error,
        meta=meta,
        timing_us=timing,
        v=v,
    )


# --------------------------------------------------------------------------- helpers


class _Missing:
    pass


_MISSING: Final = _Missing()


def _reject_ext(code: int, data: bytes) -> object:
    """msgpack's ext_hook: zero-length ext values slip past ``max_ext_len=0``,
    and ext types are outside the contract whatever their length."""
    raise ValueError(f"msgpack ext type {code} is not allowed")


def _unpack_map(value: bytes, **limits: int) -> dict[str, Any]:
    """Unpack one msgpack map, translating every failure into UndecodableRecord.

    msgpack's C unpacker bounds nesting with its own stack (StackError); the
    pure-Python fallback recurses and hits RecursionError instead. Both, and
    every length, format and trailing-data error, mean the same thing here.
    """
    try:
        obj = msgpack.unpackb(
            value,
            raw=False,
            strict_map_key=True,
            max_ext_len=0,
            ext_hook=_reject_ext,
            **limits,
        )
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise UndecodableRecord(f"not a msgpack record: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise UndecodableRecord(f"top level is {_kind(obj)}; expected a map")
    for key in obj:
        if not isinstance(key, str):
            raise UndecodableRecord(f"top-level keys must be str, got {_kind(key)}")
    return obj


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


_T = TypeVar("_T")


def _expect(x: object, typ: type[_T], path: str) -> _T:
    if not isinstance(x, typ):
        raise ValueError(f"{path}: expected {_KIND_NAMES.get(typ, typ.__name__)}, got {_kind(x)}")
    return x


def _expect_count(x: object, path: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(f"{path}: expected int, got {_kind(x)}")
    if x < 0:
        raise ValueError(f"{path}: must be >= 0, got {x}")
    return x


_KIND_NAMES: Final[dict[type, str]] = {
    type(None): "nil",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bin",
    list: "array",
    dict: "map",
}


def _kind(x: object) -> str:
    """The msgpack name of a value's type, for messages read by clients who
    may never have seen Python."""
    return _KIND_NAMES.get(type(x), type(x).__name__)


def _name(x: object) -> str:
    """A client-chosen name, made safe and short enough for a message."""
    s = x if isinstance(x, str) else repr(x)
    if len(s) > _MAX_NAME_IN_MESSAGE:
        s = s[:_MAX_NAME_IN_MESSAGE] + "..."
    return s


def _versions() -> str:
    return ", ".join(map(str, SUPPORTED_VERSIONS))
