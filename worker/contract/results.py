"""Results: the value of an output-topic record (contract v1)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

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
    DTYPES,
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
)


def encode_result(res: Result) -> bytes:
    """Encode a result with exactly the contract's fields (``error`` and
    ``meta`` only when set)."""
    outputs = {name: t.to_wire() for name, t in res.outputs.items()}
    return pack(
        _result_wire(
            res.v, res.id, res.status, outputs, res.error, res.model, res.source, res.timing_us,
            res.meta,
        )
    )  # fmt: skip


def encode_ok_result(
    request_id: str,
    outputs: Mapping[str, np.ndarray],
    model: ModelInfo,
    source: Source,
    timing_us: Mapping[str, int],
    meta: Mapping[str, Any] | None,
) -> bytes:
    """The hot path: an ``ok`` result straight from the engine's output rows,
    byte for byte what ``encode_result`` makes of the same result, without
    building and validating a ``Result`` and a ``Tensor`` per output (the
    worker's own arrays need no validation)."""
    wire_outputs = {name: _row_wire(arr) for name, arr in outputs.items()}
    return pack(
        _result_wire(1, request_id, "ok", wire_outputs, None, model, source, timing_us, meta)
    )


# Native dtypes whose bytes are already wire bytes (little-endian hosts), by
# dtype object: a dict lookup is far cheaper per row than ``dtype.name``.
_NATIVE_WIRE_NAMES: Final[dict[np.dtype[Any], str]] = (
    {np.dtype(name): name for name in DTYPES} if sys.byteorder == "little" else {}
)


def _row_wire(arr: np.ndarray) -> dict[str, Any]:
    name = _NATIVE_WIRE_NAMES.get(arr.dtype)
    if name is not None:
        return {"dtype": name, "shape": list(arr.shape), "data": arr.tobytes()}
    return Tensor.from_numpy(arr).to_wire()  # converts the byte order, or refuses the dtype


def _result_wire(
    v: int,
    request_id: str,
    status: str,
    outputs: dict[str, Any],
    error: ErrorInfo | None,
    model: ModelInfo,
    source: Source,
    timing_us: Mapping[str, int],
    meta: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The one place the result map's fields and their order are written.
    Integers are coerced with ``int()`` so numpy scalars from timing or offsets
    cannot make msgpack fail on the hot path."""
    wire: dict[str, Any] = {"v": v, "id": request_id, "status": status, "outputs": outputs}
    if error is not None:
        wire["error"] = {"code": error.code, "message": error.message}
    wire["model"] = {"name": model.name, "version": model.version}
    wire["source"] = {
        "topic": source.topic,
        "partition": int(source.partition),
        "offset": int(source.offset),
    }
    wire["timing_us"] = {k: int(t) for k, t in timing_us.items()}
    if meta is not None:
        wire["meta"] = dict(meta)
    return wire


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
