"""The Open Inference Protocol v2 (KServe v2) in JSON, beside msgpack: the same
requests and results, in the format Triton, KServe, MLServer and Seldon Core 2
speak, for producers that cannot write msgpack (kcat, Kafka Connect, ksqlDB, a
web backend). A record with header ``content-type: application/json`` is one.

Request: ``{"id", "parameters"?, "inputs": [{"name", "shape", "datatype",
"data", "parameters"?}], "outputs"?: [{"name"}], "model_name"?, "model_version"?}``,
one record one request (the model named as OIP's gRPC request names it; over HTTP
the path does).
``data`` is the flat row-major list (nested lists are accepted and flattened);
a leading batch dimension of 1 in ``shape`` is allowed (the intake drops it
where the model's row has one dimension fewer). ``BYTES`` carries texts (UTF-8
strings, one element) and, with ``parameters.content_type = "base64"`` (the
convention MLServer uses), an image file base64-encoded. Request
``parameters`` may hold ``deadline_ms``; the rest are echoed back like a
msgpack request's ``meta``. ``outputs`` names the outputs the answer carries.

Result: ``{"id", "model_name", "model_version", "outputs": [{"name", "shape",
"datatype", "data"}], "parameters": {"status", "source", "timing_us", ...}}``,
shapes with a leading batch dimension of 1; an error is ``{"id", "error":
message, "parameters": {"code", "status": "error", ...}}``. A value that is not
a JSON object at all cannot be answered (no id): it goes to the DLQ like
undecodable msgpack. Limits are those of msgpack requests, the record size
checked before parsing. The client's side (writing requests, reading answers)
is ``worker.contract.oip_client``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from worker.contract.limits import DEFAULT_LIMITS, Limits
from worker.contract.requests import decode_encoded, decode_text, name_problem
from worker.contract.wire import kind, short_name
from worker.flow.errors import InvalidRequest, RecordTooLarge, TensorTooLarge, UndecodableRecord
from worker.flow.values import (
    ErrorInfo,
    InputValue,
    ModelInfo,
    ModelRef,
    Request,
    Source,
    Tensor,
)

CONTENT_TYPE: Final = "application/json"
MSGPACK: Final = "application/msgpack"

# OIP datatypes <-> the contract's dtypes (no 64-bit unsigned on the wire).
DATATYPES: Final = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
TO_OIP: Final = {v: k for k, v in DATATYPES.items()}
# By dtype object, for each output row: numpy computes ``dtype.name`` per call
# (2 us); a byte order other than the native one is looked up by name.
TO_OIP_BY_DTYPE: Final = {np.dtype(name): oip for name, oip in TO_OIP.items()}
REQUEST_KEYS: Final = ("id", "parameters", "inputs", "outputs", "model_name", "model_version")
INPUT_KEYS: Final = ("name", "shape", "datatype", "data", "parameters")


@dataclass(frozen=True)
class OipRequest:
    """An OIP request: the contract's ``Request``, and the outputs it names (None:
    every output the worker returns)."""

    request: Request
    outputs: tuple[str, ...] | None = None


def decode_oip_request(value: bytes | None, limits: Limits = DEFAULT_LIMITS) -> OipRequest:
    """An OIP v2 JSON request as the contract's ``Request``; the same exceptions
    as ``decode_request`` (``UndecodableRecord``: DLQ; ``InvalidRequest``: an error
    answer carrying the recovered id and parameters)."""
    if not value:
        raise UndecodableRecord("record value is empty")
    if len(value) > limits.max_record_bytes:
        raise RecordTooLarge(
            f"record is {len(value)} bytes; the limit is {limits.max_record_bytes}"
        )
    try:
        obj = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise UndecodableRecord(f"not a JSON record: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise UndecodableRecord(f"top level is {_json_kind(obj)}; expected an object")
    raw_id = obj.get("id", "")
    request_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= limits.max_id_chars else ""
    params = obj.get("parameters")
    meta = (
        {k: v for k, v in params.items() if k not in _PARAMETERS}
        if isinstance(params, dict)
        else None
    )
    try:
        unknown = [k for k in obj if k not in REQUEST_KEYS]
        if unknown:
            raise InvalidRequest(
                f"{short_name(unknown[0])}: unknown field; an OIP request has "
                f"{', '.join(REQUEST_KEYS)}"
            )
        if not isinstance(raw_id, str) or len(raw_id) > limits.max_id_chars:
            raise InvalidRequest(
                f"id: expected a string of at most {limits.max_id_chars} characters"
            )
        deadline = _deadline(params, meta, limits)
        start, end = (_flag(params, f) for f in ("sequence_start", "sequence_end"))
        model = _model(obj, limits)
        inputs = _inputs(obj.get("inputs"), limits)
        outputs = _outputs(obj.get("outputs"))
    except InvalidRequest as exc:
        exc.request_id, exc.meta = request_id, meta
        raise
    request = Request(
        v=1, id=request_id, inputs=inputs, deadline_ms=deadline, meta=meta or None,
        sequence_start=start, sequence_end=end, model=model,
    )  # fmt: skip
    return OipRequest(request, outputs)


def _model(obj: Mapping[str, Any], limits: Limits) -> ModelRef | None:
    """The model the request names (``model_name``) and the version it pins."""
    found: list[str | None] = []
    for field in ("model_name", "model_version"):
        raw = obj.get(field)
        problem = name_problem(raw, limits) if field in obj else None
        if problem is not None:
            raise InvalidRequest(f"{field}: {problem}")
        found.append(raw)
    name, version = found
    if name is None:
        if version is not None:
            raise InvalidRequest("model_version: names a version of the model in model_name")
        return None
    return ModelRef(name, version)


_JSON_KINDS: Final[dict[type, str]] = {dict: "an object", list: "an array", str: "a string"}


def _json_kind(x: object) -> str:
    return _JSON_KINDS.get(type(x), type(x).__name__)


# Parameters the worker reads; every other one is echoed back as meta.
_PARAMETERS: Final = ("deadline_ms", "sequence_start", "sequence_end")


def _flag(params: object, name: str) -> bool:
    value = params.get(name, False) if isinstance(params, dict) else False
    if not isinstance(value, bool):
        raise InvalidRequest(f"parameters.{name}: expected true or false")
    return value


def _deadline(params: object, meta: Mapping[str, Any] | None, limits: Limits) -> int | None:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise InvalidRequest(f"parameters: expected an object, got {_json_kind(params)}")
    if meta is not None and len(json.dumps(meta)) > limits.max_meta_bytes:
        raise InvalidRequest(f"parameters: more than {limits.max_meta_bytes} bytes to echo")
    deadline = params.get("deadline_ms")
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, int) or deadline < 0:
        raise InvalidRequest("parameters.deadline_ms: expected an integer >= 0 (epoch ms)")
    return deadline


def _outputs(raw: object) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                            for o in raw):  # fmt: skip
        raise InvalidRequest('outputs: expected a list of {"name": ...}')
    return tuple(o["name"] for o in raw)


def _inputs(raw: object, limits: Limits) -> dict[str, InputValue]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("inputs: expected a non-empty list of tensors")
    if len(raw) > limits.max_inputs:
        raise InvalidRequest(f"inputs: expected 1 to {limits.max_inputs} tensors, got {len(raw)}")
    out: dict[str, InputValue] = {}
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidRequest(f"inputs[{i}]: expected an object with a name")
        name = entry["name"]
        path = f"inputs.{short_name(name)}"
        unknown = [k for k in entry if k not in INPUT_KEYS]
        if unknown:
            raise InvalidRequest(f"{path}.{short_name(unknown[0])}: unknown field")
        for key in ("shape", "datatype", "data"):
            if key not in entry:
                raise InvalidRequest(f"{path}.{key}: missing")
        if name in out:
            raise InvalidRequest(f"{path}: given twice")
        out[name] = _input(entry, path, limits)
    return out


def _input(entry: Mapping[str, Any], path: str, limits: Limits) -> InputValue:
    shape, datatype, data = entry["shape"], entry["datatype"], entry["data"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              and d >= 0 for d in shape):  # fmt: skip
        raise InvalidRequest(f"{path}.shape: expected a list of integers >= 0")
    if len(shape) > limits.max_rank + 1:
        raise InvalidRequest(f"{path}.shape: rank must be at most {limits.max_rank + 1}")
    if datatype == "BYTES":
        return _bytes(entry, shape, data, path, limits)
    if datatype not in DATATYPES:
        raise InvalidRequest(
            f"{path}.datatype: {short_name(datatype)!r} is not one of BYTES, {', '.join(DATATYPES)}"
        )
    dtype = DATATYPES[datatype]
    count = math.prod(shape)
    if count * np.dtype(dtype).itemsize > limits.max_tensor_bytes:
        raise TensorTooLarge(
            f"{path}: {datatype} {shape} is {count * np.dtype(dtype).itemsize} bytes; the limit "
            f"is {limits.max_tensor_bytes}"
        )
    try:
        arr = np.asarray(data, dtype=np.float64 if dtype.startswith("float") else None)
        if arr.size != count:
            raise InvalidRequest(f"{path}.data: {arr.size} values for shape {shape} ({count})")
        if dtype == "bool" and arr.dtype != np.bool_:
            raise InvalidRequest(f"{path}.data: BOOL values must be true or false")
        if dtype != "bool" and arr.size and arr.dtype.kind not in "iuf":
            raise InvalidRequest(f"{path}.data: expected numbers, got {arr.dtype.name}")
        if dtype.startswith("float") and not np.isfinite(arr).all():
            raise InvalidRequest(f"{path}.data: non-finite values (NaN or Inf)")
        if dtype[0] in "iu" and arr.size and arr.dtype.kind == "f":
            raise InvalidRequest(f"{path}.data: {datatype} takes integers")
        cast = arr.astype(dtype).reshape(shape)
        if dtype[0] in "iu" and arr.size and not np.array_equal(cast, arr.reshape(shape)):
            raise InvalidRequest(f"{path}.data: values out of {datatype}'s range")
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidRequest(f"{path}.data: {exc}") from None
    return Tensor.from_numpy(cast)


def _bytes(
    entry: Mapping[str, Any], shape: list[int], data: object, path: str, limits: Limits
) -> InputValue:
    """BYTES: one text (a string), or one image file (base64, with
    ``parameters.content_type = "base64"``)."""
    items = data if isinstance(data, list) else [data]
    while len(items) == 1 and isinstance(items[0], list):
        items = items[0]
    if math.prod(shape) != 1 or len(items) != 1 or not isinstance(items[0], str):
        raise InvalidRequest(f"{path}: BYTES takes one string per request (shape [1])")
    text = items[0]
    params = entry.get("parameters") or {}
    if isinstance(params, dict) and params.get("content_type") == "base64":
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(f"{path}.data: not base64 ({exc})") from None
        return decode_encoded(raw, path, limits, what="base64 data", hint="")
    return decode_text(text, path, limits)


# --- results ------------------------------------------------------------------------


def encode_oip_result(
    request_id: str,
    model: ModelInfo,
    source: Source,
    timing_us: Mapping[str, int],
    meta: Mapping[str, Any] | None,
    outputs: Mapping[str, np.ndarray] | None = None,
    error: ErrorInfo | None = None,
    partial: Mapping[str, Any] | None = None,
) -> bytes:
    """An OIP v2 response (``outputs`` one row each, shaped ``[1, ...]``) or an
    OIP error, with what the contract adds under ``parameters`` (``partial``: a
    pipeline's answer without every step, as the msgpack result's)."""
    params: dict[str, Any] = {
        "status": "error" if error is not None else "ok",
        "source": {
            "topic": source.topic,
            "partition": int(source.partition),
            "offset": int(source.offset),
        },
        "timing_us": {k: int(t) for k, t in timing_us.items()},
    }
    if meta:
        params["meta"] = dict(meta)
    if partial is not None and error is None:
        params["partial"] = dict(partial)
    if error is not None:
        params["code"] = error.code
        body: dict[str, Any] = {"id": request_id, "error": error.message, "parameters": params}
    else:
        body = {
            "id": request_id,
            "model_name": model.name,
            "model_version": model.version,
            "outputs": [_tensor(name, arr) for name, arr in (outputs or {}).items()],
            "parameters": params,
        }
    return json.dumps(body, separators=(",", ":"), default=plain_json).encode()


def _tensor(name: str, arr: np.ndarray) -> dict[str, Any]:
    row = np.asarray(arr)
    data = row.reshape(-1).tolist()
    return {"name": name, "shape": [1, *row.shape], "datatype": datatype_of(row.dtype),
            "data": data}  # fmt: skip


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The OIP datatype of a numpy dtype (``FP32``, ``INT64``, ``BOOL``...)."""
    found = TO_OIP_BY_DTYPE.get(dtype) or TO_OIP.get(dtype.name)
    if found is None:  # float widths numpy may hand back: reported as FP32/FP64
        return "FP64" if dtype.itemsize == 8 else "FP32"
    return found


def plain_json(value: object) -> object:
    """Meta values JSON cannot carry as they are (bytes from a msgpack client):
    ``json.dumps``'s ``default``."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    raise TypeError(f"{kind(value)} is not JSON")
