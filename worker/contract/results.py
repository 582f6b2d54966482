"""Results: the value of an output-topic record (contract v1)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from worker.contract.wire import (
    TENSOR_FIELDS,
    expect,
    expect_count,
    kind,
    pack,
    short_name,
    unpack_map,
    versions_text,
)
from worker.flow.errors import UndecodableRecord
from worker.flow.values import (
    SUPPORTED_VERSIONS,
    ErrorInfo,
    ModelInfo,
    Result,
    Source,
    Tensor,
    is_int,
)

RESULT_FIELDS: Final = (
    "v",
    "id",
    "status",
    "outputs",
    "error",
    "model",
    "source",
    "timing_us",
    "meta",
    "partial",
)


class _TensorWire(msgspec.Struct):
    dtype: str
    shape: list[int]
    data: bytes


class _ErrorWire(msgspec.Struct):
    code: str
    message: str


class _SourceWire(msgspec.Struct):
    topic: str
    partition: int
    offset: int


class _ResultWire(msgspec.Struct, omit_defaults=True, kw_only=True):
    """The one place the result map's fields and their order are written:
    msgspec writes a Struct as a map of its fields in this order, leaving out
    ``error`` and ``meta`` when they are None (the contract: only when set)."""

    v: int
    id: str
    status: str
    outputs: dict[str, _TensorWire]
    error: _ErrorWire | None = None
    model: msgspec.Raw  # the model's map, encoded once per model (``model_map``)
    source: _SourceWire
    timing_us: dict[str, int]
    meta: Any = None
    partial: Any = None  # a pipeline's answer without every step: only when set


_ENCODER: Final = msgspec.msgpack.Encoder()


def encode_result(res: Result) -> bytes:
    """Encode a result with exactly the contract's fields (``error`` and
    ``meta`` only when set)."""
    outputs = {name: _tensor_wire(t) for name, t in res.outputs.items()}
    error = None if res.error is None else _ErrorWire(res.error.code, res.error.message)
    return _pack(res.v, res.id, res.status, outputs, error, res.model, res.source,
                 res.timing_us, res.meta, res.partial)  # fmt: skip


def _tensor_wire(t: Tensor) -> _TensorWire:
    return _TensorWire(t.dtype, list(t.shape), t.data)


@functools.lru_cache(maxsize=64)
def model_map(name: str, version: str) -> msgspec.Raw:
    """The model's map as msgpack, once per model (every result carries it)."""
    return msgspec.Raw(_ENCODER.encode({"name": name, "version": version}))


def _pack(
    v: int,
    request_id: str,
    status: str,
    outputs: dict[str, _TensorWire],
    error: _ErrorWire | None,
    model: ModelInfo,
    source: Source,
    timing_us: Mapping[str, int],
    meta: Mapping[str, Any] | None,
    partial: Mapping[str, Any] | None = None,
) -> bytes:
    """The result's msgpack bytes, byte for byte what ``msgpack.packb(map,
    use_bin_type=True)`` writes for the contract's map (a property test holds
    them equal). Integers are coerced with ``int()`` so numpy scalars from timing
    or offsets cannot make encoding fail on the hot path. An echoed ``meta``
    msgspec will not write (a bytes map key) is written by msgpack, whose errors
    the caller gets (``pack``)."""
    wire = _ResultWire(
        v=v, id=request_id, status=status, outputs=outputs, error=error,
        model=model_map(model.name, model.version),
        source=_SourceWire(source.topic, int(source.partition), int(source.offset)),
        timing_us={k: int(t) for k, t in timing_us.items()},
        meta=meta if meta is None or isinstance(meta, dict) else dict(meta),
        partial=None if partial is None else dict(partial),
    )  # fmt: skip
    try:
        return _ENCODER.encode(wire)
    except (TypeError, ValueError, OverflowError, RecursionError):
        if meta is None:
            raise
        wire.meta = msgspec.Raw(pack(dict(meta)))
        return _ENCODER.encode(wire)


def decode_result(value: bytes) -> Result:
    """Decode a result: for clients, tests and the demo.

    Bytes that are not a msgpack map raise ``UndecodableRecord``; a map that
    breaks the contract raises ``ValueError`` naming the field. Results come
    from the worker, so limits are msgpack's defaults (nothing may claim more
    than the buffer holds) rather than ``Limits``.
    """
    if not value:
        raise UndecodableRecord("record value is empty")
    obj = unpack_map(value)
    for key in obj:
        if key not in RESULT_FIELDS:
            raise ValueError(
                f"{short_name(key)}: unknown field; result v1 has {', '.join(RESULT_FIELDS)}"
            )
    for key in ("v", "id", "status", "outputs", "model", "source", "timing_us"):
        if key not in obj:
            raise ValueError(f"{key}: missing")
    v = obj["v"]
    if not is_int(v) or v not in SUPPORTED_VERSIONS:
        raise ValueError(f"v: unsupported version {v!r}; supported versions: {versions_text()}")
    status = obj["status"]
    if status not in ("ok", "error"):
        raise ValueError(f"status: expected 'ok' or 'error', got {status!r}")
    return Result(
        id=expect(obj["id"], str, "id"),
        status=status,
        source=_decode_source(obj["source"]),
        model=_decode_model(obj["model"]),
        outputs=_decode_outputs(obj["outputs"]),
        error=_decode_error(obj["error"]) if "error" in obj else None,
        meta=expect(obj["meta"], dict, "meta") if "meta" in obj else None,
        timing_us=_decode_timing(obj["timing_us"]),
        v=v,
        partial=expect(obj["partial"], dict, "partial") if "partial" in obj else None,
    )


def _exact_keys(m: dict[Any, Any], keys: tuple[str, ...], path: str) -> None:
    if set(m) != set(keys):
        raise ValueError(f"{path}: expected exactly {', '.join(keys)}; got {sorted(map(str, m))}")


def _decode_outputs(raw: object) -> dict[str, Tensor]:
    outputs: dict[str, Tensor] = {}
    for name, value in expect(raw, dict, "outputs").items():
        path = f"outputs.{short_name(name)}"
        if not isinstance(name, str):
            raise ValueError(f"outputs: names must be str, got {kind(name)}")
        t = expect(value, dict, path)
        _exact_keys(t, TENSOR_FIELDS, path)
        shape = expect(t["shape"], list, f"{path}.shape")
        try:
            outputs[name] = Tensor(
                expect(t["dtype"], str, f"{path}.dtype"),
                tuple(shape),
                expect(t["data"], bytes, f"{path}.data"),
            )
        except ValueError as exc:
            raise ValueError(f"{path}.{exc}") from None
    return outputs


def _decode_error(raw: object) -> ErrorInfo:
    e = expect(raw, dict, "error")
    _exact_keys(e, ("code", "message"), "error")
    return ErrorInfo(
        expect(e["code"], str, "error.code"), expect(e["message"], str, "error.message")
    )


def _decode_model(raw: object) -> ModelInfo:
    m = expect(raw, dict, "model")
    _exact_keys(m, ("name", "version"), "model")
    return ModelInfo(
        expect(m["name"], str, "model.name"), expect(m["version"], str, "model.version")
    )


def _decode_source(raw: object) -> Source:
    s = expect(raw, dict, "source")
    _exact_keys(s, ("topic", "partition", "offset"), "source")
    return Source(
        expect(s["topic"], str, "source.topic"),
        expect_count(s["partition"], "source.partition"),
        expect_count(s["offset"], "source.offset"),
    )


def _decode_timing(raw: object) -> dict[str, int]:
    timing: dict[str, int] = {}
    for k, t_us in expect(raw, dict, "timing_us").items():
        if not isinstance(k, str):
            raise ValueError(f"timing_us: keys must be str, got {kind(k)}")
        timing[k] = expect_count(t_us, f"timing_us.{short_name(k)}")
    return timing
