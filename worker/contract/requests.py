"""Requests: the value of an input-topic record (contract v1).

Everything that arrives is hostile until proven otherwise: the record's size is
checked before msgpack sees a byte, and msgpack itself runs with length limits,
no ext types and a bounded nesting depth, so a small record cannot make the
worker allocate a large one. A record that is not a msgpack map cannot be
answered (there is no id), so it becomes ``UndecodableRecord`` and goes to the
DLQ with its bytes intact; a map that breaks the contract becomes
``InvalidRequest`` carrying whatever id and meta could be recovered, so the
client gets an error result it can correlate; every message names the field.

Two steps, one set of rules. A typed msgspec decode reads the common request
(the wire types checked in C, no intermediate dicts), then the value rules run
on its fields (``_accept``): what it accepts is exactly what the field-by-field
reading accepts, the same ``Request`` (a property test holds the two equal).
Anything it does not accept is read again field by field (``_explain``), which
refuses it with the message naming the first field at fault, or, for the rare
valid request the typed decode declines (a non-canonical encoding), accepts it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgpack
import msgspec

from worker.contract.limits import DEFAULT_LIMITS, Limits
from worker.contract.tensors import decode_tensor, tensor_from_fields
from worker.contract.wire import (
    MISSING,
    MODEL_FIELDS,
    REQUEST_FIELDS,
    kind,
    pack,
    reject_ext,
    short_name,
    unpack_map,
    versions_text,
)
from worker.flow.errors import InvalidRequest, RecordTooLarge, TensorTooLarge, UndecodableRecord
from worker.flow.values import (
    SUPPORTED_VERSIONS,
    EncodedImage,
    InputValue,
    ModelRef,
    Request,
    is_int,
    sniff_format,
)


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
    accepted = _accept(value, limits)
    return accepted if accepted is not None else _explain(value, limits)


class _WireTensor(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]  # a bool is not an int here
    data: bytes


class _WireModel(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    version: str | msgspec.UnsetType = msgspec.UNSET


class _WireRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The request's wire types. Optional fields are UNSET when absent, so an
    explicit nil is not taken for "absent" (it is refused, as by ``_explain``);
    ``meta`` stays raw, to be read with the contract's msgpack defences."""

    v: int
    id: str
    # msgspec unions hold one str-like type: a bin (an image file) declines the
    # typed decode and is read field by field (its decoding costs far more).
    inputs: dict[str, _WireTensor | str]
    deadline_ms: int | msgspec.UnsetType = msgspec.UNSET
    meta: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    sequence_start: bool = False
    sequence_end: bool = False
    model: _WireModel | msgspec.UnsetType = msgspec.UNSET


_TYPED = msgspec.msgpack.Decoder(_WireRequest, ext_hook=reject_ext)
_DECLINED = (msgspec.MsgspecError, ValueError, TypeError, RecursionError, OverflowError)


def _accept(value: bytes, limits: Limits) -> Request | None:
    """The request when it satisfies every rule, else None (``_explain`` says why)."""
    try:
        wire = _TYPED.decode(value)
    except _DECLINED:
        return None
    if wire.v not in SUPPORTED_VERSIONS or _id_problem(wire.id, limits) is not None:
        return None
    deadline = None if wire.deadline_ms is msgspec.UNSET else wire.deadline_ms
    if deadline is not None and deadline < 0:
        return None
    meta: dict[str, Any] | None = None
    if wire.meta is not msgspec.UNSET:
        try:
            # Inside a one-element array: msgpack bounds nesting from the top of
            # what it unpacks, and in the request the meta sits one level down
            # (read alone, a meta one level too deep passed; its result then
            # could not be decoded).
            meta = msgpack.unpackb(
                b"\x91" + bytes(wire.meta), raw=False, strict_map_key=True, max_ext_len=0,
                ext_hook=reject_ext, max_bin_len=limits.max_record_bytes,
                max_str_len=limits.max_string_bytes, max_array_len=limits.max_array_len,
                max_map_len=limits.max_map_len,
            )[0]  # fmt: skip
        except (ValueError, TypeError, RecursionError, msgpack.UnpackException):
            return None
        if _meta_problem(meta, limits) is not None:
            return None
    if not 1 <= len(wire.inputs) <= limits.max_inputs:
        return None
    model = None
    if wire.model is not msgspec.UNSET:
        version = None if wire.model.version is msgspec.UNSET else wire.model.version
        model = ModelRef(wire.model.name, version)
        if any(name_problem(x, limits) for x in (model.name, version) if x is not None):
            return None
    if len(value) > limits.max_string_bytes and not _strings_within(wire, limits.max_string_bytes):
        return None  # a string longer than msgpack's limit: undecodable, as read field by field
    inputs: dict[str, InputValue] = {}
    try:
        # Messages are not read here (a refusal is explained by ``_explain``),
        # so the path they would name is not built per input.
        for name, raw in wire.inputs.items():
            if isinstance(raw, _WireTensor):
                inputs[name] = tensor_from_fields(raw.dtype, raw.shape, raw.data, "inputs",
                                                  limits, typed=True)  # fmt: skip
            else:
                inputs[name] = decode_text(raw, "inputs", limits)
    except (InvalidRequest, TensorTooLarge):
        return None
    return Request(
        v=wire.v, id=wire.id, inputs=inputs, deadline_ms=deadline, meta=meta,
        sequence_start=wire.sequence_start, sequence_end=wire.sequence_end,
        model=model,
    )  # fmt: skip


def _strings_within(wire: _WireRequest, limit: int) -> bool:
    """Every string of the request within ``limit`` UTF-8 bytes (msgpack's
    ``max_str_len``, which the field-by-field reading unpacks under)."""
    strings = [wire.id, *wire.inputs]
    if wire.model is not msgspec.UNSET:
        strings.append(wire.model.name)
    for raw in wire.inputs.values():
        if isinstance(raw, str):
            strings.append(raw)
        elif isinstance(raw, _WireTensor):
            strings.append(raw.dtype)
    return all(len(s.encode("utf-8", "surrogatepass")) <= limit for s in strings)


def _explain(value: bytes, limits: Limits) -> Request:
    """Read the request field by field, in the contract's order, and raise the
    error naming the first field at fault (or return the request)."""
    obj = unpack_map(
        value,
        max_bin_len=limits.max_record_bytes,
        max_str_len=limits.max_string_bytes,
        max_array_len=limits.max_array_len,
        max_map_len=limits.max_map_len,
    )
    # Recover what the error reply needs before judging anything else, so every
    # contract violation below can still be correlated by the client.
    id_problem = _id_problem(obj.get("id", MISSING), limits)
    meta_problem = _meta_problem(obj["meta"], limits) if "meta" in obj else None
    request_id: str = obj["id"] if id_problem is None else ""
    meta: dict[str, Any] | None = obj.get("meta") if meta_problem is None else None
    try:
        _check_version_and_fields(obj)
        if id_problem is not None:
            raise InvalidRequest(id_problem)
        deadline_ms = _decode_deadline(obj)
        start, end = (_decode_flag(obj, f) for f in ("sequence_start", "sequence_end"))
        if meta_problem is not None:
            raise InvalidRequest(meta_problem)
        model = _decode_model(obj, limits)
        inputs = _decode_inputs(obj, limits)
    except InvalidRequest as exc:
        exc.request_id = request_id
        exc.meta = meta
        raise
    return Request(
        v=obj["v"], id=request_id, inputs=inputs, deadline_ms=deadline_ms, meta=meta,
        sequence_start=start, sequence_end=end, model=model,
    )  # fmt: skip


def encode_request(req: Request) -> bytes:
    """The client side of the contract; used by tests, the demo and benchmarks."""
    wire: dict[str, Any] = {
        "v": req.v,
        "id": req.id,
        "inputs": {name: _input_wire(t) for name, t in req.inputs.items()},
    }
    if req.deadline_ms is not None:
        wire["deadline_ms"] = int(req.deadline_ms)
    if req.meta is not None:
        wire["meta"] = dict(req.meta)
    for flag in ("sequence_start", "sequence_end"):
        if getattr(req, flag):
            wire[flag] = True
    if req.model is not None:
        wire["model"] = {"name": req.model.name}
        if req.model.version is not None:
            wire["model"]["version"] = req.model.version
    return pack(wire)


def _input_wire(value: InputValue) -> object:
    if isinstance(value, EncodedImage):
        return value.data
    if isinstance(value, str):
        return value
    return value.to_wire()


def _check_version_and_fields(obj: dict[str, Any]) -> None:
    # Version first: a v2 request is best answered "unsupported version", not
    # with complaints about fields v1 does not know.
    if "v" not in obj:
        raise InvalidRequest(f"v: missing; supported versions: {versions_text()}")
    v = obj["v"]
    if not is_int(v):
        raise InvalidRequest(f"v: expected int, got {kind(v)}")
    if v not in SUPPORTED_VERSIONS:
        raise InvalidRequest(f"v: unsupported version {v}; supported versions: {versions_text()}")
    # Unknown keys are rejected rather than ignored: a misspelt "deadline" that
    # silently does nothing is worse than an error the client sees at once.
    for key in obj:
        if key not in REQUEST_FIELDS:
            raise InvalidRequest(
                f"{short_name(key)}: unknown field; request v1 has {', '.join(REQUEST_FIELDS)}"
            )


def _decode_flag(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name}: expected true or false, got {kind(value)}")
    return value


def _decode_model(obj: dict[str, Any], limits: Limits) -> ModelRef | None:
    """The model the request names and the version it pins (``{"name", "version"?}``,
    as a result's ``model``), or None when it names none."""
    if "model" not in obj:
        return None
    raw = obj["model"]
    if not isinstance(raw, dict):
        raise InvalidRequest(f"model: expected a map {{name, version?}}, got {kind(raw)}")
    for key in raw:
        if key not in MODEL_FIELDS:
            raise InvalidRequest(f"model.{short_name(key)}: unknown field; model has name, version")
    if "name" not in raw:
        raise InvalidRequest("model.name: missing")
    for field in (f for f in MODEL_FIELDS if f in raw):  # a nil version is refused too
        problem = name_problem(raw[field], limits)
        if problem is not None:
            raise InvalidRequest(f"model.{field}: {problem}")
    return ModelRef(raw["name"], raw.get("version"))


def name_problem(raw: object, limits: Limits) -> str | None:
    """Why ``raw`` is not a model's name or version, or None when it is."""
    if not isinstance(raw, str):
        return f"expected str, got {kind(raw)}"
    if not 1 <= len(raw) <= limits.max_id_chars:
        return f"length must be 1 to {limits.max_id_chars}, got {len(raw)}"
    return None


def _decode_deadline(obj: dict[str, Any]) -> int | None:
    if "deadline_ms" not in obj:
        return None
    d = obj["deadline_ms"]
    if not is_int(d):
        raise InvalidRequest(
            f"deadline_ms: expected int (absolute epoch ms), got {kind(d)}; "
            "omit the field for no deadline"
        )
    if d < 0:
        raise InvalidRequest(f"deadline_ms: must be >= 0, got {d}")
    return int(d)


def _decode_inputs(obj: dict[str, Any], limits: Limits) -> dict[str, InputValue]:
    if "inputs" not in obj:
        raise InvalidRequest("inputs: missing")
    raw_inputs = obj["inputs"]
    if not isinstance(raw_inputs, dict):
        raise InvalidRequest(f"inputs: expected a map of name -> tensor, got {kind(raw_inputs)}")
    if not 1 <= len(raw_inputs) <= limits.max_inputs:
        raise InvalidRequest(
            f"inputs: expected 1 to {limits.max_inputs} tensors, got {len(raw_inputs)}"
        )
    inputs: dict[str, InputValue] = {}
    for name, raw in raw_inputs.items():
        if not isinstance(name, str):
            raise InvalidRequest(f"inputs: tensor names must be str, got {kind(name)}")
        path = f"inputs.{short_name(name)}"
        if isinstance(raw, bytes):
            inputs[name] = decode_encoded(raw, path, limits)
        elif isinstance(raw, str):
            inputs[name] = decode_text(raw, path, limits)
        else:
            inputs[name] = decode_tensor(raw, path, limits)
    return inputs


def decode_text(raw: str, path: str, limits: Limits) -> str:
    """A str input is a text, for the model's tokenizer (checked against the model's
    inputs at intake: only a text input takes one). Both wire formats use it."""
    nbytes = len(raw.encode("utf-8", "surrogatepass"))
    if nbytes > limits.max_text_bytes:
        raise TensorTooLarge(
            f"{path}: text of {nbytes} UTF-8 bytes; the limit is {limits.max_text_bytes}"
        )
    return raw


def decode_encoded(
    raw: bytes,
    path: str,
    limits: Limits,
    what: str = "bin",
    hint: str = "; send an image file or a tensor map {dtype, shape, data}",
) -> EncodedImage:
    """A bin input (``what``: how the request carried the bytes) is an image file:
    JPEG, PNG or WebP by its magic bytes. Both wire formats use it."""
    if len(raw) > limits.max_tensor_bytes:
        raise TensorTooLarge(
            f"{path}: encoded image of {len(raw)} bytes; the limit is {limits.max_tensor_bytes}"
        )
    fmt = sniff_format(raw)
    if fmt is None:
        raise InvalidRequest(
            f"{path}: {what} is not a JPEG, PNG or WebP file (starts with "
            f"{raw[:8].hex() or 'nothing'}){hint}"
        )
    return EncodedImage(fmt, raw)


def _id_problem(raw: object, limits: Limits) -> str | None:
    """Why ``raw`` is not a usable id, or None when it is."""
    if raw is MISSING:
        return "id: missing"
    if not isinstance(raw, str):
        return f"id: expected str, got {kind(raw)}"
    if not 1 <= len(raw) <= limits.max_id_chars:
        return f"id: length must be 1 to {limits.max_id_chars}, got {len(raw)}"
    return None


def _meta_problem(raw: object, limits: Limits) -> str | None:
    """Why ``raw`` cannot be echoed as meta, or None when it can."""
    if not isinstance(raw, dict):
        return f"meta: expected a map, got {kind(raw)}"
    for key in raw:
        if not isinstance(key, str):
            return f"meta: keys must be str, got {kind(key)}"
    # The echo costs what its re-encoding costs, so that is what is limited.
    try:
        size = len(pack(raw))
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        return f"meta: cannot be re-encoded ({exc})"
    if size > limits.max_meta_bytes:
        return f"meta: {size} bytes when encoded; the limit is {limits.max_meta_bytes}"
    return None
