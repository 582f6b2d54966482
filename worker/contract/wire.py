"""Shared ground of the wire contract: msgpack with limits, names, vocabularies.

Internal to ``worker.contract``: the message modules (tensors, requests,
results) build on these helpers so that every message is unpacked with the
same defences and every error message speaks the same language (msgpack type
names, short client-chosen names).
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

import msgpack
import msgspec

from worker.flow.errors import UndecodableRecord
from worker.flow.values import SUPPORTED_VERSIONS

REQUEST_FIELDS: Final = (
    "v", "id", "inputs", "deadline_ms", "meta", "sequence_start", "sequence_end", "model",
)  # fmt: skip
MODEL_FIELDS: Final = ("name", "version")
TENSOR_FIELDS: Final = ("dtype", "shape", "data")

# A client-chosen name in an error message is cut to this many characters.
MAX_NAME_IN_MESSAGE: Final = 64


class Missing:
    pass


MISSING: Final = Missing()


def reject_ext(code: int, data: bytes | memoryview) -> object:
    """msgpack's ext_hook: zero-length ext values slip past ``max_ext_len=0``,
    and ext types are outside the contract whatever their length."""
    raise ValueError(f"msgpack ext type {code} is not allowed")


def unpack_map(value: bytes, **limits: int) -> dict[str, Any]:
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
            ext_hook=reject_ext,
            **limits,
        )
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise UndecodableRecord(f"not a msgpack record: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise UndecodableRecord(f"top level is {kind(obj)}; expected a map")
    for key in obj:
        if not isinstance(key, str):
            raise UndecodableRecord(f"top-level keys must be str, got {kind(key)}")
    return obj


_ENCODER = msgspec.msgpack.Encoder()


def pack(obj: object) -> bytes:
    """msgpack bytes of ``obj``, written by msgspec's encoder (a result's map in
    a third of the time, issue 36), byte for byte what ``msgpack.packb(obj,
    use_bin_type=True)`` writes: the smallest form of every int, float64
    floats, str and bin types (a property test holds the two equal). What
    msgspec will not encode goes to msgpack, which also raises the errors
    callers expect: a bytes map key in an echoed ``meta``, or nesting deeper
    than Python's recursion limit allows msgspec. msgpack refuses nesting past
    1024 levels, which msgspec does not; nothing the worker encodes nests that
    deep, since a request's meta is read under msgpack's bound."""
    try:
        return _ENCODER.encode(obj)
    except (TypeError, ValueError, OverflowError, RecursionError):
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
        return packed


_T = TypeVar("_T")


def expect(x: object, typ: type[_T], path: str) -> _T:
    if not isinstance(x, typ):
        raise ValueError(f"{path}: expected {KIND_NAMES.get(typ, typ.__name__)}, got {kind(x)}")
    return x


def expect_count(x: object, path: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(f"{path}: expected int, got {kind(x)}")
    if x < 0:
        raise ValueError(f"{path}: must be >= 0, got {x}")
    return x


KIND_NAMES: Final[dict[type, str]] = {
    type(None): "nil",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bin",
    list: "array",
    dict: "map",
}


def kind(x: object) -> str:
    """The msgpack name of a value's type, for messages read by clients who
    may never have seen Python."""
    return KIND_NAMES.get(type(x), type(x).__name__)


def short_name(x: object) -> str:
    """A client-chosen name, made safe and short enough for a message."""
    s = x if isinstance(x, str) else repr(x)
    if len(s) > MAX_NAME_IN_MESSAGE:
        s = s[:MAX_NAME_IN_MESSAGE] + "..."
    return s


def versions_text() -> str:
    return ", ".join(map(str, SUPPORTED_VERSIONS))
