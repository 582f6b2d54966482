"""Requests and results in a Schema Registry's Avro wire format
(docs/guides/schema-registry.md): the framing and the fields' meaning are every
format's (``worker.contract.registered``); the Avro binary of one record after
it, encoded and decoded by fastavro (the ``registry`` extra), never by hand.

An array field's item type gives its tensor's dtype: ``float`` float32,
``double`` float64, ``int`` int32, ``long`` int64, ``boolean`` bool.

A result is the record ``RESULT`` (``result_schema``): ``v``, ``id``,
``status``, ``model``, ``error``, ``source``, ``timing_us``, ``meta``,
``partial``, and one field per output the worker can answer with (``{shape,
values}``, nullable, null where the answer has no such output).
"""

from __future__ import annotations

import importlib
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from worker.contract.avro_ok import OkPieces, avro_value
from worker.contract.registered import (
    HEADER_BYTES,
    MAGIC,
    Field,
    Format,
    OutputDesc,
    field_name,
    outputs_of,
    result_record,
)
from worker.flow.errors import UndecodableRecord
from worker.flow.values import Result

_ITEM_DTYPES: Final = {
    "float": "float32", "double": "float64", "int": "int32", "long": "int64", "boolean": "bool",
}  # fmt: skip
# A dtype's Avro item type in results (wider where Avro has no narrower one).
_AVRO_OF: Final = {
    "float32": "float", "float16": "float", "float64": "double", "int64": "long",
    "uint32": "long", "int32": "int", "int16": "int", "int8": "int", "uint16": "int",
    "uint8": "int", "bool": "boolean",
}  # fmt: skip


def _fastavro() -> Any:
    try:
        import fastavro
    except ImportError as exc:  # the registry extra is not installed
        raise UndecodableRecord(
            "an Avro record needs fastavro: pip install 'infer-worker[registry]'"
        ) from exc
    return fastavro


# --- requests ------------------------------------------------------------------


# schemaless_reader's defaults, as it passes them to its reading function.
_READ_OPTIONS: Final = {
    "return_record_name": False, "return_record_name_override": False,
    "handle_unicode_errors": "strict", "return_named_type": False,
    "return_named_type_override": False,
}  # fmt: skip


@dataclass(frozen=True)
class WriterSchema:
    """A request schema as the registry holds it, parsed once (by id)."""

    schema_id: int
    parsed: Any  # fastavro's parsed schema
    fields: Mapping[str, Field]
    # The record's reader, made once (``_body_reader``).
    body: Callable[[io.BytesIO], Any] = field(repr=False, compare=False)

    @property
    def format(self) -> Format:
        return "avro"

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
        return cls(schema_id, parsed, fields, _body_reader(parsed))

    def read(self, value: bytes) -> dict[str, Any]:
        """The record's fields; ``UndecodableRecord`` where the bytes are not one."""
        try:
            record = self.body(io.BytesIO(value[HEADER_BYTES:]))
        except Exception as exc:  # boundary: truncated or foreign bytes
            raise UndecodableRecord(
                f"not an Avro record of schema {self.schema_id}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(record, dict):
            raise UndecodableRecord(f"schema {self.schema_id}: the record is not a record")
        return record


def _body_reader(parsed: Any) -> Callable[[io.BytesIO], Any]:
    """fastavro's reading function as its ``schemaless_reader`` calls it, with the
    named types collected once: that wrapper collects them and makes its options
    per record (0.7 of the 5.6 us a two-array record took). The function is its
    compiled module's, without a public name: where missing (a pure-Python
    fastavro), the wrapper (a unit test holds both equal)."""
    read_data = getattr(importlib.import_module("fastavro._read"), "_read_data", None)
    if read_data is None:
        reader = _fastavro().schemaless_reader
        return lambda body: reader(body, parsed, None)
    named: dict[str, Any] = {"writer": {}, "reader": {}}
    _fastavro().parse_schema(parsed, named["writer"])
    return lambda body: read_data(body, parsed, named, None, _READ_OPTIONS)


def _field(avro_type: Any) -> Field:
    """A field's kind, a nullable union read as its other branch."""
    if isinstance(avro_type, list):
        branches = [b for b in avro_type if b != "null"]
        return _field(branches[0]) if len(branches) == 1 else Field("other")
    if isinstance(avro_type, str):
        return Field(avro_type if avro_type in ("bytes", "string") else "other")
    if isinstance(avro_type, dict) and avro_type.get("type") == "array":
        items = avro_type["items"]
        if isinstance(items, dict) and items.get("type") == "array":
            inner = _field(items)
            return Field("array", inner.dtype, True) if inner.kind == "array" else Field("other")
        if isinstance(items, str) and items in _ITEM_DTYPES:
            return Field("array", _ITEM_DTYPES[items])
    return Field("other")


# --- results -------------------------------------------------------------------


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
        for f in schema["fields"]:
            branch = f["type"][1] if isinstance(f["type"], list) else None
            if isinstance(branch, dict) and branch.get("name", "").startswith("Output_"):
                typed = any(x["name"] == "values" for x in branch["fields"])
                self._outputs[f["name"]] = (f"{prefix}{branch['name']}", typed)
        # Ok answers from pieces encoded once, where they provably write what the
        # whole record would (else None: written whole).
        self._ok = OkPieces.of(self._parsed, self._header, self._outputs)

    def encode(self, result: Result, arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
        """``result`` in Avro; ``arrays``: its outputs as the stage gave them, instead
        of ``result.outputs`` (no wire tensor made for an answer sent in Avro)."""
        record = result_record(result)
        if record["error"] is not None:
            record["error"] = (self._error, record["error"])
        if record["partial"] is not None:
            record["partial"] = (self._partial, record["partial"])
        return self._write(record, outputs_of(result, arrays))

    def encode_ok(self, record: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
        if self._ok is not None:
            return self._ok.encode(record, arrays)
        return self._write(record, arrays)

    def _write(self, record: dict[str, Any], outputs: Mapping[str, Any]) -> bytes:
        for output, given in outputs.items():
            key = field_name(output)
            named = self._outputs.get(key)
            if named is not None:  # an output the schema does not name: not sent
                record[key] = (named[0], avro_value(given, named[1]))
        out = io.BytesIO()
        out.write(self._header)
        _fastavro().schemaless_writer(out, self._parsed, record)
        return out.getvalue()
