"""The tools' side of the Schema Registry: a result in a registry format (Avro,
JSON Schema, Protobuf: ``worker.contract.registered``) read back into the
contract's ``Result``, with the schema of its id fetched once, so ``verify``,
``compare`` and ``consume`` read such answers as they read msgpack ones.

An output comes back as the tensor its field holds: its values' dtype is the
field's item type (Avro ``float`` float32, ``double`` float64, ``long`` int64,
``int`` int32, ``boolean`` bool; JSON ``number`` float64, ``integer`` int64;
Protobuf as Avro), its shape the field's; an output carried as bytes keeps its
own dtype. Fields are named as the worker names them (``field_name``).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from worker.config import SchemaRegistryConfig
from worker.contract import ErrorInfo, ModelInfo, Result, Source, Tensor
from worker.contract.registered import FORMATS, HEADER_BYTES, RESERVED, RequestSchema, schema_id
from worker.flow.errors import UndecodableRecord
from worker.kafka.registry import NotFound, SchemaRegistry, Unreachable, request_schema

_ENVELOPE: Final = frozenset(
    {"v", "id", "status", "model", "error", "source", "timing_us", "meta", "partial"}
)
_AVRO_DTYPES: Final = {"float": "float32", "double": "float64", "long": "int64", "int": "int32",
                       "boolean": "bool"}  # fmt: skip
_JSON_DTYPES: Final = {"number": "float64", "integer": "int64", "boolean": "bool"}

Reader = Callable[[bytes], tuple[dict[str, Any], Mapping[str, str]]]


class RegistryResults:
    """Reads results in a registry format (``result``); schemas fetched once by id."""

    def __init__(self, cfg: SchemaRegistryConfig) -> None:
        self._registry = SchemaRegistry(cfg)
        self._readers: dict[int, Reader] = {}
        self._requests: dict[int, RequestSchema] = {}

    def request(self, value: bytes) -> dict[str, Any]:
        """A request's fields (``compare --label-key`` reads its ``meta``), read with
        the request schema of its id; ``UndecodableRecord`` where it cannot be."""
        sid = _schema_id(value)
        if sid not in self._requests:
            kind, text = self._schema(sid)
            fmt = FORMATS.get(kind)
            try:
                if fmt is None:
                    raise ValueError(f"schema id {sid} is {kind}")
                self._requests[sid] = request_schema(sid, fmt, text, self._registry)
            except (ValueError, Unreachable) as exc:
                raise UndecodableRecord(str(exc)) from exc
        return self._requests[sid].read(value)

    def result(self, value: bytes) -> Result:
        """``UndecodableRecord`` for a value that is no result this can read."""
        sid = _schema_id(value)
        if sid not in self._readers:
            kind, text = self._schema(sid)
            self._readers[sid] = _reader(kind, text, sid, self._registry)
        try:
            record, dtypes = self._readers[sid](value)
            return _result(record, dtypes)
        except (KeyError, TypeError, ValueError) as exc:
            raise UndecodableRecord(f"not a result of schema {sid}: {exc}") from exc

    def _schema(self, sid: int) -> tuple[str, str]:
        try:
            return self._registry.schema(sid)
        except (NotFound, Unreachable) as exc:
            raise UndecodableRecord(f"schema id {sid}: {exc}") from exc


def _schema_id(value: bytes) -> int:
    sid = schema_id(value)
    if sid is None:
        raise UndecodableRecord("not in the Schema Registry's format")
    return sid


def _reader(kind: str, text: str, sid: int, registry: SchemaRegistry) -> Reader:
    if kind == "AVRO":
        return _avro(text)
    if kind == "JSON":
        return _json(text)
    if kind == "PROTOBUF":
        return _protobuf(text, sid, registry)
    raise UndecodableRecord(f"schema id {sid} is {kind}")


def _avro(text: str) -> Reader:
    import fastavro

    schema = json.loads(text)
    parsed = fastavro.parse_schema(schema)
    dtypes = {}
    for f in schema["fields"]:
        branch = f["type"][1] if isinstance(f["type"], list) else None
        if isinstance(branch, dict) and branch.get("name", "").startswith("Output_"):
            values = [x for x in branch["fields"] if x["name"] == "values"]
            if values:
                dtypes[f["name"]] = _AVRO_DTYPES[values[0]["type"]["items"]]

    def read(value: bytes) -> tuple[dict[str, Any], Mapping[str, str]]:
        record = fastavro.schemaless_reader(io.BytesIO(value[HEADER_BYTES:]), parsed, None)
        if not isinstance(record, dict):
            raise ValueError("not a record")
        return record, dtypes

    return read


def _json(text: str) -> Reader:
    schema = json.loads(text)
    dtypes = {}
    for name, prop in schema.get("properties", {}).items():
        branch = prop.get("anyOf", [{}, {}])[1] if isinstance(prop, dict) else {}
        values = branch.get("properties", {}).get("values") if isinstance(branch, dict) else None
        if values is not None:
            dtypes[name] = _JSON_DTYPES[values["items"]["type"]]

    def read(value: bytes) -> tuple[dict[str, Any], Mapping[str, str]]:
        record = json.loads(value[HEADER_BYTES:])
        for name in record.keys() - _ENVELOPE:
            out = record[name]
            if isinstance(out, dict) and isinstance(out.get("data"), str):
                out["data"] = base64.b64decode(out["data"])
        return record, dtypes

    return read


def _protobuf(text: str, sid: int, registry: SchemaRegistry) -> Reader:
    from google.protobuf import descriptor_pool, message_factory
    from google.protobuf.json_format import MessageToDict

    from worker.contract.protobuf import descriptor_of

    try:
        fdp = descriptor_of(text)
    except ValueError:  # a .proto text: as the registry serializes it
        fdp = descriptor_of(registry.schema(sid, serialized=True)[1])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    top = fdp.message_type[0]
    name = f"{fdp.package}.{top.name}" if fdp.package else top.name
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
    kinds = {1: "float64", 2: "float32", 3: "int64", 5: "int32", 8: "bool"}  # Type enum
    dtypes = {}
    for field in top.field:
        for nested in top.nested_type:
            if field.type_name.endswith(f".{nested.name}") and nested.name.startswith("Output_"):
                values = [x for x in nested.field if x.name == "values"]
                if values:
                    dtypes[field.name] = kinds.get(values[0].type, "float64")

    def read(value: bytes) -> tuple[dict[str, Any], Mapping[str, str]]:
        message = cls.FromString(value[HEADER_BYTES + 1 :])  # after the index [0]
        try:
            record = MessageToDict(message, preserving_proto_field_name=True,
                                   always_print_fields_with_no_presence=True)  # fmt: skip
        except TypeError:  # protobuf before 5.26 names it so
            record = MessageToDict(message, preserving_proto_field_name=True,
                                   including_default_value_fields=True)  # fmt: skip
        for key in record.keys() - _ENVELOPE:
            out = record[key]
            if isinstance(out, dict) and isinstance(out.get("data"), str):
                out["data"] = base64.b64decode(out["data"])
        return record, dtypes

    return read


def _result(record: Mapping[str, Any], dtypes: Mapping[str, str]) -> Result:
    outputs = {}
    for name, out in record.items():
        if name in _ENVELOPE or name in RESERVED or not isinstance(out, dict):
            continue
        shape = tuple(int(d) for d in out.get("shape", []))
        if "data" in out:
            outputs[name] = Tensor(str(out["dtype"]), shape, bytes(out["data"]))
        else:
            arr = np.asarray(out.get("values", []), dtype=dtypes.get(name, "float64"))
            outputs[name] = Tensor.from_numpy(arr.reshape(shape))
    error = record.get("error")
    source, model = record["source"], record["model"]
    return Result(
        id=str(record["id"]), status=record["status"],
        source=Source(source["topic"], int(source["partition"]), int(source["offset"])),
        model=ModelInfo(model["name"], model["version"]),
        outputs=outputs if not error else {},
        error=ErrorInfo(error["code"], error["message"]) if error else None,
        meta=record.get("meta") or None,
        timing_us={k: int(v) for k, v in (record.get("timing_us") or {}).items()},
        partial=record.get("partial") or None,
    )  # fmt: skip
