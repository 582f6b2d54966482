"""Requests and results in a Schema Registry's Avro wire format
(docs/guides/schema-registry.md): a zero magic byte, the schema's id (4 bytes,
big-endian), then the Avro binary of one record. Encoded and decoded by
fastavro (the ``registry`` extra), never by hand; the registry itself is
``worker.kafka.registry``.

A request record's fields, by name:

- ``id`` (string, required), ``deadline_ms`` (long), ``model`` and
  ``model_version`` (string: the model a request names, as msgpack's
  ``model``), ``meta`` (map of strings, echoed), ``sequence_start`` and
  ``sequence_end`` (boolean): as the msgpack request's; any of them may be
  nullable (a union with null) and absent;
- every other field that names an input of the answering model is that input
  (any other field is left alone: a topic's schema evolves for every reader of
  it, and a field added for another is no error): an array of numbers or
  booleans (nested arrays give the shape; a flat one takes the shape of a field
  ``NAME_shape``, else the model input's fixed shape) becomes a tensor of the
  item type's dtype (``float`` float32, ``double`` float64, ``int`` int32,
  ``long`` int64, ``boolean`` bool); ``bytes`` an image file where the input is
  an image, else the input's raw tensor (its dtype and fixed shape); a
  ``string`` a text. A null leaves the input out.

A result is the record ``RESULT`` (``result_schema``): ``v``, ``id``,
``status``, ``model``, ``error``, ``source``, ``timing_us``, ``meta``,
``partial``, and one field per output the worker can answer with (``{shape,
values}``, nullable, null where the answer has no such output).
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from worker.flow.errors import InvalidRequest, UndecodableRecord
from worker.flow.values import EncodedImage, ModelRef, Request, Result, Tensor, sniff_format

MAGIC: Final = b"\x00"
HEADER_BYTES: Final = 5
RESERVED: Final = (
    "id", "deadline_ms", "model", "model_version", "meta", "sequence_start", "sequence_end",
)  # fmt: skip
_ITEM_DTYPES: Final = {
    "float": "float32", "double": "float64", "int": "int32", "long": "int64", "boolean": "bool",
}  # fmt: skip
_WIRE: Final = {name: np.dtype(name).newbyteorder("<") for name in _ITEM_DTYPES.values()}
# A dtype's Avro item type in results (wider where Avro has no narrower one).
_AVRO_OF: Final = {
    "float32": "float", "float16": "float", "float64": "double", "int64": "long",
    "uint32": "long", "int32": "int", "int16": "int", "int8": "int", "uint16": "int",
    "uint8": "int", "bool": "boolean",
}  # fmt: skip
_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class InputsView:
    """What a request's answerer takes, by input name: which inputs are images,
    and each tensor input's dtype and row shape where every dimension is fixed."""

    names: frozenset[str]  # every input it takes
    images: frozenset[str]
    fixed: Mapping[str, tuple[str, tuple[int, ...]]]


def _fastavro() -> Any:
    try:
        import fastavro
    except ImportError as exc:  # the registry extra is not installed
        raise UndecodableRecord(
            "an Avro record needs fastavro: pip install 'infer-worker[registry]'"
        ) from exc
    return fastavro


def schema_id(value: bytes) -> int | None:
    """The schema id of a record in the registry's wire format, else None."""
    if len(value) < HEADER_BYTES or value[:1] != MAGIC:
        return None
    return int.from_bytes(value[1:HEADER_BYTES], "big")


# --- requests ------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    kind: str  # "array", "bytes", "string" or "other"
    dtype: str = ""  # an array's items'
    nested: bool = False  # an array of arrays


@dataclass(frozen=True)
class WriterSchema:
    """A request schema as the registry holds it, parsed once (by id)."""

    schema_id: int
    parsed: Any  # fastavro's parsed schema
    fields: Mapping[str, _Field]

    @classmethod
    def of(cls, schema_id: int, text: str) -> WriterSchema:
        """Raises ``ValueError`` naming what is wrong with the schema."""
        fastavro = _fastavro()
        try:
            parsed = fastavro.parse_schema(json.loads(text))
        except Exception as exc:  # boundary: fastavro's and json's errors
            raise ValueError(f"schema {schema_id} is not an Avro schema: {exc}") from exc
        if not isinstance(parsed, dict) or parsed.get("type") != "record":
            raise ValueError(f"schema {schema_id} is not an Avro record")
        fields = {f["name"]: _field(f["type"]) for f in parsed["fields"]}
        return cls(schema_id, parsed, fields)

    def read(self, value: bytes) -> dict[str, Any]:
        """The record's fields; ``UndecodableRecord`` where the bytes are not one."""
        try:
            record = _fastavro().schemaless_reader(io.BytesIO(value[HEADER_BYTES:]), self.parsed,
                                                   None)  # fmt: skip
        except Exception as exc:  # boundary: truncated or foreign bytes
            raise UndecodableRecord(
                f"not an Avro record of schema {self.schema_id}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(record, dict):
            raise UndecodableRecord(f"schema {self.schema_id}: the record is not a record")
        return record


def _field(avro_type: Any) -> _Field:
    """A field's kind, a nullable union read as its other branch."""
    if isinstance(avro_type, list):
        branches = [b for b in avro_type if b != "null"]
        return _field(branches[0]) if len(branches) == 1 else _Field("other")
    if isinstance(avro_type, str):
        return _Field(avro_type if avro_type in ("bytes", "string") else "other")
    if isinstance(avro_type, dict) and avro_type.get("type") == "array":
        items = avro_type["items"]
        if isinstance(items, dict) and items.get("type") == "array":
            inner = _field(items)
            return _Field("array", inner.dtype, True) if inner.kind == "array" else _Field("other")
        if isinstance(items, str) and items in _ITEM_DTYPES:
            return _Field("array", _ITEM_DTYPES[items])
    return _Field("other")


def request_of(record: Mapping[str, Any], schema: WriterSchema, takes: InputsView) -> Request:
    """The request a record of ``schema`` is (see the module docstring); ``takes``:
    the answering model's inputs."""
    rid = record.get("id")
    if not isinstance(rid, str):
        raise UndecodableRecord(f"schema {schema.schema_id}: the record has no string field id")
    meta = record.get("meta")
    meta = meta if isinstance(meta, dict) else None
    inputs: dict[str, Any] = {}
    for name, value in record.items():
        # A field no input of the answerer takes is another reader's (a topic's schema
        # evolves for all of them): left alone. An input no field gives: the model's
        # check names it.
        if name in RESERVED or value is None or name not in takes.names:
            continue
        try:
            field = schema.fields.get(name, _Field("other"))
            inputs[name] = _input(name, value, field, record.get(f"{name}_shape"), takes)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"inputs.{name[:64]}: {exc}", request_id=rid, meta=meta) from exc
    model = record.get("model")
    version = record.get("model_version")
    deadline = record.get("deadline_ms")
    return Request(
        v=1, id=rid, inputs=inputs, deadline_ms=deadline if isinstance(deadline, int) else None,
        meta=meta, sequence_start=bool(record.get("sequence_start")),
        sequence_end=bool(record.get("sequence_end")),
        model=ModelRef(model, version if isinstance(version, str) else None)
        if isinstance(model, str) else None,
    )  # fmt: skip


def _input(name: str, value: Any, field: _Field, shape: Any, takes: InputsView) -> Any:
    if isinstance(value, str):
        return value
    fixed = takes.fixed.get(name)
    if isinstance(value, bytes):
        if name in takes.images:
            fmt = sniff_format(value)
            if fmt is None:
                raise ValueError("bytes that are not an image file the worker reads")
            return EncodedImage(fmt, value)
        if fixed is None:
            raise ValueError("bytes for an input that is no image and no tensor of a fixed "
                             "shape (send an array)")  # fmt: skip
        dtype, row = fixed
        return Tensor(dtype, row, value)  # its size is checked against the shape here
    if isinstance(value, list):
        if not field.dtype:  # an array of no numeric item type
            return Tensor.from_numpy(np.asarray(value))
        # Straight into wire form (little-endian, C order): no dtype look-ups per record.
        arr = np.array(value, dtype=_WIRE[field.dtype])
        if shape is not None:
            arr = arr.reshape([int(d) for d in shape])
        elif (arr.ndim == 1 and not field.nested and fixed is not None
              and len(fixed[1]) != 1 and arr.size == int(np.prod(fixed[1]))):  # fmt: skip
            arr = arr.reshape(fixed[1])
        return Tensor(field.dtype, arr.shape, arr.tobytes())
    raise ValueError(f"an Avro {type(value).__name__} is not a model input")


# --- results -------------------------------------------------------------------

OutputDesc = tuple[str, tuple[Any, ...]] | None  # an output's dtype and shape, if declared


@functools.lru_cache(maxsize=1024)
def field_name(output: str) -> str:
    """An output's field: its name where Avro takes it, else with ``_`` for each
    character it does not."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", output)
    return name if _NAME.fullmatch(name) else f"_{name}"


def result_schema(
    name: str, namespace: str, outputs: Mapping[str, OutputDesc]
) -> dict[str, Any]:
    """The result record for answers carrying any of ``outputs`` (by name, each
    with its dtype where declared: typed values; else a tensor's dtype, shape and
    bytes). Two outputs whose fields would share a name: ``ValueError``."""
    fields: list[dict[str, Any]] = [
        {"name": "v", "type": "int"},
        {"name": "id", "type": "string"},
        {"name": "status", "type": "string"},
        {"name": "model", "type": {"type": "record", "name": "Model", "fields": [
            {"name": "name", "type": "string"}, {"name": "version", "type": "string"}]}},
        {"name": "error", "type": ["null", {"type": "record", "name": "Error", "fields": [
            {"name": "code", "type": "string"}, {"name": "message", "type": "string"}]}],
         "default": None},
        {"name": "source", "type": {"type": "record", "name": "Source", "fields": [
            {"name": "topic", "type": "string"}, {"name": "partition", "type": "int"},
            {"name": "offset", "type": "long"}]}},
        {"name": "timing_us", "type": {"type": "map", "values": "long"}},
        {"name": "meta", "type": ["null", {"type": "map", "values": "string"}], "default": None},
        # A pipeline's answer without every step (the v1 contract's optional partial).
        {"name": "partial", "type": ["null", {"type": "record", "name": "Partial", "fields": [
            {"name": "skipped", "type": {"type": "array", "items": "string"}, "default": []},
            {"name": "failed", "type": {"type": "array", "items": {
                "type": "record", "name": "Failed", "fields": [
                    {"name": "step", "type": "string"}, {"name": "code", "type": "string"},
                    {"name": "message", "type": "string"}]}}, "default": []}]}],
         "default": None},
    ]  # fmt: skip
    taken = {f["name"] for f in fields}
    for output, desc in sorted(outputs.items()):
        key = field_name(output)
        if key in taken:
            raise ValueError(f"output {output!r}: its Avro field {key!r} is taken")
        taken.add(key)
        item = _AVRO_OF.get(desc[0]) if desc is not None else None
        record: dict[str, Any] = {"type": "record", "name": f"Output_{key}", "fields": [
            {"name": "shape", "type": {"type": "array", "items": "long"}}]}  # fmt: skip
        if item is not None:
            record["fields"].append({"name": "values", "type": {"type": "array", "items": item}})
        else:
            record["fields"] += [{"name": "dtype", "type": "string"},
                                 {"name": "data", "type": "bytes"}]  # fmt: skip
        fields.append({"name": key, "type": ["null", record], "default": None})
    return {"type": "record", "name": name, "namespace": namespace, "fields": fields}


class AvroResults:
    """Results encoded with the output topic's registered result schema."""

    def __init__(self, schema: Mapping[str, Any], registered_id: int) -> None:
        self.schema_id = registered_id
        self._parsed = _fastavro().parse_schema(dict(schema))
        self._header = MAGIC + registered_id.to_bytes(4, "big")
        prefix = f"{schema['namespace']}." if schema.get("namespace") else ""
        self._error, self._partial = f"{prefix}Error", f"{prefix}Partial"
        # Each output field's record: its full name (the union's branch, named when
        # written: fastavro then need not try each branch against the value), and
        # whether it carries typed values.
        self._outputs: dict[str, tuple[str, bool]] = {}
        namespace = schema.get("namespace", "")
        for f in schema["fields"]:
            branch = f["type"][1] if isinstance(f["type"], list) else None
            if isinstance(branch, dict) and branch.get("name", "").startswith("Output_"):
                typed = any(x["name"] == "values" for x in branch["fields"])
                full = f"{namespace}.{branch['name']}" if namespace else branch["name"]
                self._outputs[f["name"]] = (full, typed)

    def encode(self, result: Result, arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
        """``result`` in Avro; ``arrays``: its outputs as the stage gave them, instead
        of ``result.outputs`` (no wire tensor made for an answer sent in Avro)."""
        record: dict[str, Any] = {
            "v": result.v, "id": result.id, "status": result.status,
            "model": {"name": result.model.name, "version": result.model.version},
            "error": None if result.error is None
            else (self._error, {"code": result.error.code, "message": result.error.message}),
            "source": {"topic": result.source.topic, "partition": result.source.partition,
                       "offset": result.source.offset},
            "timing_us": dict(result.timing_us),
            "meta": None if result.meta is None
            else {str(k): str(v) for k, v in result.meta.items()},
            "partial": None if result.partial is None
            else (self._partial, {"skipped": list(result.partial.get("skipped", [])),
                                  "failed": list(result.partial.get("failed", []))}),
        }  # fmt: skip
        outputs: Mapping[str, Any] = result.outputs if arrays is None else arrays
        for output, given in outputs.items():
            key = field_name(output)
            named = self._outputs.get(key)
            if named is None:
                continue  # an output the schema does not name: not sent
            tensor = given if isinstance(given, Tensor) else None
            arr = tensor.to_numpy() if tensor is not None else np.asarray(given)
            value: dict[str, Any] = {"shape": list(arr.shape)}
            if named[1]:
                value["values"] = arr.reshape(-1).tolist()
            else:
                tensor = tensor or Tensor.from_numpy(arr)
                value["dtype"], value["data"] = tensor.dtype, tensor.data
            record[key] = (named[0], value)
        out = io.BytesIO()
        out.write(self._header)
        _fastavro().schemaless_writer(out, self._parsed, record)
        return out.getvalue()
