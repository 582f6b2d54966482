"""``ok`` results on the hot path: the result map written from pieces encoded
once and reused, instead of a wire struct built and encoded per answer.

An ``ok`` result of one model differs from the next only in its id, its output
rows' bytes, its offset, its timings and its meta: the map's keys, the output
names, dtypes and shapes, the model map and the source's topic and partition
repeat from one answer to the next. Those are encoded once (cached by what they
depend on) and the varying parts are encoded alone and joined, byte for byte
what ``msgpack.packb(map, use_bin_type=True)`` writes for the contract's map (a
property test holds them equal, ``tests/unit/contract/test_pack_identity.py``).
A field takes the smallest form msgpack has for it, whatever its neighbours, so
the pieces of one map can be encoded apart.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Final

import msgspec
import numpy as np

from worker.contract.results import model_map
from worker.contract.wire import pack
from worker.flow.values import DTYPES, ModelInfo, Source, Tensor

_encode: Final = msgspec.msgpack.Encoder().encode

# Native dtypes whose bytes are already wire bytes (little-endian hosts), by
# dtype object: a dict lookup is far cheaper per row than ``dtype.name``.
_NATIVE_WIRE_NAMES: Final[dict[np.dtype[Any], str]] = (
    {np.dtype(name): name for name in DTYPES} if sys.byteorder == "little" else {}
)

# A cache holds at most this many pieces, then starts again: output shapes are
# fixed for most models, but free output dimensions could make them unbounded.
_MAX_CACHED: Final = 4096


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x80 | n,))
    return (b"\xde" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xdf" + n.to_bytes(4, "big"))


def _bin_header(n: int) -> bytes:
    """msgpack's bin header for ``n`` bytes (bin 8, 16 or 32: the smallest)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    return (b"\xc5" + n.to_bytes(2, "big")) if n < 1 << 16 else (b"\xc6" + n.to_bytes(4, "big"))


def _head(fields: int) -> bytes:
    return _map_header(fields) + _encode("v") + _encode(1) + _encode("id")


# The result map: v, id, status, outputs, model, source, timing_us (and meta).
_HEAD: Final = _head(7)
_HEAD_META: Final = _head(8)
_STATUS_OUTPUTS: Final = _encode("status") + _encode("ok") + _encode("outputs")
_TIMING: Final = _encode("timing_us")
_META: Final = _encode("meta")

_outputs: dict[tuple[str, str, tuple[int, ...]], bytes] = {}
_sources: dict[tuple[str, str, str, int], bytes] = {}


def _output_prefix(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """An output's name and its tensor map up to its data's bytes (the bin header)."""
    key = (name, dtype, shape)
    prefix = _outputs.get(key)
    if prefix is None:
        if len(_outputs) >= _MAX_CACHED:
            _outputs.clear()
        bin_header = _bin_header(nbytes)
        prefix = _outputs[key] = (
            _encode(name) + _map_header(3) + _encode("dtype") + _encode(dtype)
            + _encode("shape") + _encode(list(shape)) + _encode("data") + bin_header
        )  # fmt: skip
    return prefix


def _source_prefix(model: ModelInfo, topic: str, partition: int) -> bytes:
    """The model map and the source map up to the offset's value."""
    key = (model.name, model.version, topic, partition)
    prefix = _sources.get(key)
    if prefix is None:
        if len(_sources) >= _MAX_CACHED:
            _sources.clear()
        prefix = _sources[key] = (
            _encode("model") + bytes(model_map(model.name, model.version))
            + _encode("source") + _map_header(3) + _encode("topic") + _encode(topic)
            + _encode("partition") + _encode(int(partition)) + _encode("offset")
        )  # fmt: skip
    return prefix


def encode_ok_result(
    request_id: str,
    outputs: Mapping[str, np.ndarray],
    model: ModelInfo,
    source: Source,
    timing_us: Mapping[str, int],
    meta: Mapping[str, Any] | None,
) -> bytes:
    """An ``ok`` result straight from the engine's output rows, byte for byte
    what ``encode_result`` makes of the same result, without building and
    validating a ``Result`` and a ``Tensor`` per output (the worker's own arrays
    need no validation). Timings must be ints (the stages' ``round()`` and
    ``micros()``); they, the partition and the offset may be numpy integers.
    An echoed ``meta`` msgspec will not write (a bytes map key) is written by
    msgpack, whose errors the caller gets (``pack``)."""
    return encode_ok_at(
        request_id, outputs, model, source.topic, source.partition, source.offset, timing_us, meta
    )


def encode_ok_at(
    request_id: str,
    outputs: Mapping[str, np.ndarray],
    model: ModelInfo,
    topic: str,
    partition: int,
    offset: int,
    timing_us: Mapping[str, int],
    meta: Mapping[str, Any] | None,
) -> bytes:
    """``encode_ok_result`` of a source given as its parts: the writer's hot
    path, which has them in the job and need not build a ``Source`` per answer."""
    parts = [_HEAD if meta is None else _HEAD_META, _encode(request_id), _STATUS_OUTPUTS,
             _map_header(len(outputs))]  # fmt: skip
    for name, arr in outputs.items():
        dtype = _NATIVE_WIRE_NAMES.get(arr.dtype)
        if dtype is None:  # converts the byte order, or refuses the dtype
            tensor = Tensor.from_numpy(arr)
            dtype, shape, data = tensor.dtype, tensor.shape, tensor.data
        else:
            shape, data = arr.shape, arr.tobytes()
        # The cache looked up here, not through _output_prefix: one call less per
        # output of every answer (a miss builds the piece there).
        prefix = _outputs.get((name, dtype, shape))
        if prefix is None:
            prefix = _output_prefix(name, dtype, shape, len(data))
        parts.append(prefix)
        parts.append(data)
    parts.append(_source_prefix(model, topic, partition))
    parts.append(_encode(int(offset)))
    parts.append(_TIMING)
    try:
        parts.append(_encode(timing_us))
    except TypeError:  # numpy integers
        parts.append(_encode({k: int(t) for k, t in timing_us.items()}))
    if meta is not None:
        meta = meta if isinstance(meta, dict) else dict(meta)
        parts.append(_META)
        try:
            parts.append(_encode(meta))
        except (TypeError, ValueError, OverflowError, RecursionError):
            parts.append(pack(meta))
    return b"".join(parts)
