"""Results: the value of an output-topic record (contract v1)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from worker.contract.tensors import Tensor
from worker.contract.wire import (
    ERROR_CODES,
    MAX_ERROR_MESSAGE_CHARS,
    SUPPORTED_VERSIONS,
    TENSOR_FIELDS,
    expect,
    expect_count,
    is_int,
    kind,
    pack,
    short_name,
    unpack_map,
    versions_text,
)
from worker.errors import UndecodableRecord, WorkerError

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
            return cls(err.code, message[:MAX_ERROR_MESSAGE_CHARS])
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
    return pack(wire)


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
