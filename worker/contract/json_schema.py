"""Requests and results in a Schema Registry's JSON Schema wire format
(docs/guides/schema-registry.md): the framing and the fields' meaning are every
format's (``worker.contract.registered``); after them, one JSON object (UTF-8),
validated against its schema by the ``jsonschema`` library (the ``registry``
extra), never by hand.

A property's JSON Schema type gives its input: an ``array`` of ``number`` a
float32 tensor, of ``integer`` int64, of ``boolean`` bool (nested arrays give
the shape; the model check refuses another dtype, naming the input); a
``string`` with ``"contentEncoding": "base64"`` bytes (an image file, or a raw
tensor); any other ``string`` a text. A property may be nullable (a type list
with ``"null"``, or ``anyOf`` with ``{"type": "null"}``).

A result is one JSON object of the same fields as the Avro result record
(``result_schema``), an output without typed values carrying its bytes in
base64 (``data``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from worker.contract.registered import (
    HEADER_BYTES,
    MAGIC,
    Field,
    Format,
    OutputDesc,
    field_name,
    output_value,
    outputs_of,
    result_record,
)
from worker.flow.errors import InvalidRequest, UndecodableRecord
from worker.flow.values import Result

_ITEM_DTYPES: Final = {"number": "float32", "integer": "int64", "boolean": "bool"}
_NUMBER_OF: Final = {"float": "number", "int": "integer", "uint": "integer", "bool": "boolean"}


def _validator(schema: Mapping[str, Any]) -> Any:
    try:
        import jsonschema
    except ImportError as exc:  # the registry extra is not installed
        raise UndecodableRecord(
            "a JSON Schema record needs jsonschema: pip install 'infer-worker[registry]'"
        ) from exc
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@dataclass(frozen=True)
class JsonRequestSchema:
    """A JSON Schema request schema as the registry holds it, read once (by id)."""

    schema_id: int
    validator: Any  # the jsonschema validator of this schema
    fields: Mapping[str, Field]
    encoded: frozenset[str]  # base64 string properties: bytes

    @property
    def format(self) -> Format:
        return "jsonschema"

    @classmethod
    def of(cls, schema_id: int, text: str) -> JsonRequestSchema:
        """Raises ``ValueError`` naming what is wrong with the schema."""
        try:
            schema = json.loads(text)
            validator = _validator(schema)
        except UndecodableRecord:
            raise
        except Exception as exc:  # boundary: json's and jsonschema's errors
            raise ValueError(f"schema {schema_id} is not a JSON Schema: {exc}") from exc
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if schema.get("type") != "object" or not isinstance(properties, dict):
            raise ValueError(f"schema {schema_id} is not a JSON Schema of an object")
        fields = {name: _field(p) for name, p in properties.items()}
        encoded = frozenset(n for n, p in properties.items() if _base64(p))
        return cls(schema_id, validator, fields, encoded)

    def read(self, value: bytes) -> dict[str, Any]:
        try:
            record = json.loads(value[HEADER_BYTES:])
        except ValueError as exc:  # not UTF-8, not JSON
            raise UndecodableRecord(f"not a JSON record of schema {self.schema_id}: {exc}") from exc
        if not isinstance(record, dict):
            raise UndecodableRecord(f"schema {self.schema_id}: the record is not an object")
        error = next(iter(self.validator.iter_errors(record)), None)
        if error is not None:
            rid = record.get("id")
            where = ".".join(str(p) for p in error.absolute_path) or "the record"
            raise InvalidRequest(
                f"{where}: {error.message[:200]} (schema {self.schema_id})",
                request_id=rid if isinstance(rid, str) else "",
            )
        for name in self.encoded & record.keys():
            if isinstance(record[name], str):
                try:
                    record[name] = base64.b64decode(record[name], validate=True)
                except ValueError as exc:
                    rid = record.get("id")
                    raise InvalidRequest(f"inputs.{name}: not base64: {exc}",
                                         request_id=rid if isinstance(rid, str) else "") from exc
        return record


def _base64(prop: Any) -> bool:
    branches = prop.get("anyOf", [prop]) if isinstance(prop, dict) else []
    return any(isinstance(b, dict) and b.get("contentEncoding") == "base64" for b in branches)


def _field(prop: Any) -> Field:
    """A property's kind, a nullable one read as its other type."""
    if not isinstance(prop, dict):
        return Field("other")
    if "anyOf" in prop:
        branches = [b for b in prop["anyOf"]
                    if not (isinstance(b, dict) and b.get("type") == "null")]  # fmt: skip
        return _field(branches[0]) if len(branches) == 1 else Field("other")
    kind = prop.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind == "string":
        return Field("bytes" if prop.get("contentEncoding") == "base64" else "string")
    if kind == "array":
        items = prop.get("items")
        inner = _field(items)
        if inner.kind == "array":
            return Field("array", inner.dtype, True)
        item = items.get("type") if isinstance(items, dict) else None
        if isinstance(item, str) and item in _ITEM_DTYPES:
            return Field("array", _ITEM_DTYPES[item])
    return Field("other")


# --- results -------------------------------------------------------------------


def result_schema(
    name: str, namespace: str, outputs: Mapping[str, OutputDesc]
) -> dict[str, Any]:
    """The result object's JSON Schema (draft 7) for answers carrying any of
    ``outputs``: the Avro result record's fields, outputs nullable."""

    def nullable(schema: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [{"type": "null"}, schema]}

    strings = {"type": "object", "additionalProperties": {"type": "string"}}
    properties: dict[str, Any] = {
        "v": {"type": "integer"}, "id": {"type": "string"}, "status": {"type": "string"},
        "model": {"type": "object", "properties": {
            "name": {"type": "string"}, "version": {"type": "string"}}},
        "error": nullable({"type": "object", "properties": {
            "code": {"type": "string"}, "message": {"type": "string"}}}),
        "source": {"type": "object", "properties": {
            "topic": {"type": "string"}, "partition": {"type": "integer"},
            "offset": {"type": "integer"}}},
        "timing_us": {"type": "object", "additionalProperties": {"type": "integer"}},
        "meta": nullable(strings),
        "partial": nullable({"type": "object"}),
    }  # fmt: skip
    for output, desc in sorted(outputs.items()):
        key = field_name(output)
        if key in properties:
            raise ValueError(f"output {output!r}: its field {key!r} is taken")
        item = _item_type(desc[0]) if desc is not None else None
        value: dict[str, Any] = {"shape": {"type": "array", "items": {"type": "integer"}}}
        if item is not None:
            value["values"] = {"type": "array", "items": {"type": item}}
        else:
            value |= {"dtype": {"type": "string"},
                      "data": {"type": "string", "contentEncoding": "base64"}}  # fmt: skip
        properties[key] = nullable({"type": "object", "properties": value})
    return {"$schema": "http://json-schema.org/draft-07/schema#",
            "title": f"{namespace}.{name}", "type": "object", "properties": properties,
            "required": ["v", "id", "status", "model", "source"]}  # fmt: skip


def _item_type(dtype: str) -> str | None:
    return next((t for prefix, t in _NUMBER_OF.items() if dtype.startswith(prefix)), None)


class JsonResults:
    """Results written as JSON objects under the registered result schema."""

    def __init__(self, schema: Mapping[str, Any], registered_id: int) -> None:
        self.schema_id = registered_id
        self._header = MAGIC + registered_id.to_bytes(4, "big")
        self._typed = {
            name: "values" in p["anyOf"][1]["properties"]
            for name, p in schema["properties"].items()
            if isinstance(p, dict) and "anyOf" in p and "shape" in p["anyOf"][1].get(
                "properties", {})
        }  # fmt: skip

    def encode(self, result: Result, arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
        return self._write(result_record(result), outputs_of(result, arrays))

    def encode_ok(self, record: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
        return self._write(record, arrays)

    def _write(self, record: dict[str, Any], outputs: Mapping[str, Any]) -> bytes:
        for output, given in outputs.items():
            key = field_name(output)
            typed = self._typed.get(key)
            if typed is None:
                continue
            value = output_value(given, typed)
            if not typed:
                value["data"] = base64.b64encode(value["data"]).decode("ascii")
            record[key] = value
        return self._header + json.dumps(record, separators=(",", ":")).encode()
