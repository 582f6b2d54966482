"""Requests written in a Schema Registry format by the tools (``produce
--schema-registry``, ``benchmarks.drain --avro``): a request schema made from
the first request's inputs, registered under the input topic's subject
(``TOPIC-value``), then every request encoded with it, the fields as the worker
reads them (``worker.contract.registered``): ``id``, ``model`` and
``model_version``, ``deadline_ms``, ``meta`` (strings), and each input: a
tensor as a flat array of its item type with ``NAME_shape`` (uint8 as
integers: an image's pixels; other dtypes as raw bytes), an image file as
bytes, a text as a string.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Mapping
from typing import Any, Final

from worker.config import SchemaRegistryConfig
from worker.contract import EncodedImage, Request, Tensor
from worker.contract.registered import MAGIC, Format
from worker.flow.errors import ConfigError
from worker.kafka.registry import NotFound, SchemaRegistry, Unreachable

# A tensor dtype's item type per format (Avro, JSON Schema, Protobuf's Type enum).
_ITEMS: Final = {
    "float32": ("float", "number", 2), "float64": ("double", "number", 1),
    "int32": ("int", "integer", 5), "int64": ("long", "integer", 3),
    "bool": ("boolean", "boolean", 8), "uint8": ("int", "integer", 5),
}  # fmt: skip
_KINDS: Final = {"avro": "AVRO", "jsonschema": "JSON", "protobuf": "PROTOBUF"}


def _kind_of(value: object) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, EncodedImage):
        return "bytes"
    if isinstance(value, Tensor) and value.dtype in _ITEMS:
        return f"array:{value.dtype}"
    return "bytes"  # a tensor of another dtype: its raw bytes


class RequestEncoder:
    """Requests in ``fmt`` under ``topic``'s subject, the schema made from the first."""

    def __init__(self, cfg: SchemaRegistryConfig, fmt: Format, topic: str) -> None:
        self._registry = SchemaRegistry(cfg)
        self._format = fmt
        self._subject = f"{topic}-value"
        self._kinds: dict[str, str] | None = None
        self._header = b""
        self._message: Any = None  # Protobuf's class

    @property
    def registered(self) -> bool:
        """Whether the schema is registered (``encode`` makes no registry call then)."""
        return self._kinds is not None

    def encode(self, request: Request) -> bytes:
        kinds = {name: _kind_of(v) for name, v in request.inputs.items()}
        if self._kinds is None:
            self._register(kinds)
        elif kinds != self._kinds:
            raise ConfigError(f"requests of other inputs than the first's ({self._kinds}) cannot "
                              "share its schema: send them apart")  # fmt: skip
        record = _record(request, self._format)
        if self._format == "avro":
            import fastavro

            out = io.BytesIO()
            out.write(self._header)
            fastavro.schemaless_writer(out, self._schema, record)
            return out.getvalue()
        if self._format == "jsonschema":
            return self._header + json.dumps(record, separators=(",", ":")).encode()
        message = self._message(**{k: v for k, v in record.items() if v is not None})
        body: bytes = message.SerializeToString()
        return self._header + b"\x00" + body

    def _register(self, kinds: dict[str, str]) -> None:
        self._kinds = kinds
        made = _SCHEMAS[self._format](kinds)
        text = made if isinstance(made, str) else json.dumps(made)
        try:
            sid = self._registry.register(self._subject, text, _KINDS[self._format])
        except (Unreachable, NotFound) as exc:
            raise ConfigError(f"--schema-registry: registering the request schema under "
                              f"{self._subject!r} failed: {exc}") from exc  # fmt: skip
        self._header = MAGIC + sid.to_bytes(4, "big")
        if self._format == "avro":
            import fastavro

            self._schema = fastavro.parse_schema(made)
        elif self._format == "protobuf":
            from google.protobuf import descriptor_pool, message_factory

            from worker.contract.protobuf import descriptor_of

            pool = descriptor_pool.DescriptorPool()
            pool.Add(descriptor_of(text))
            self._message = message_factory.GetMessageClass(
                pool.FindMessageTypeByName("infer_worker.Request"))


def _record(request: Request, fmt: Format) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": request.id,
        "model": request.model.name if request.model else None,
        "model_version": request.model.version if request.model else None,
        "deadline_ms": request.deadline_ms,
        "meta": {str(k): str(v) for k, v in request.meta.items()} if request.meta else None,
    }
    for name, value in request.inputs.items():
        if isinstance(value, str):
            record[name] = value
            continue
        if isinstance(value, Tensor) and value.dtype in _ITEMS:
            arr = value.to_numpy()
            record[name] = arr.reshape(-1).tolist()
            record[f"{name}_shape"] = list(arr.shape)
            continue
        data = value.data
        record[name] = base64.b64encode(data).decode("ascii") if fmt == "jsonschema" else data
    return record


def _avro(kinds: Mapping[str, str]) -> dict[str, Any]:
    def nullable(kind: Any) -> dict[str, Any]:
        return {"type": ["null", kind], "default": None}

    fields: list[dict[str, Any]] = [
        {"name": "id", "type": "string"}, {"name": "model", **nullable("string")},
        {"name": "model_version", **nullable("string")},
        {"name": "deadline_ms", **nullable("long")},
        {"name": "meta", **nullable({"type": "map", "values": "string"})},
    ]  # fmt: skip
    for name, kind in kinds.items():
        if kind.startswith("array:"):
            item = _ITEMS[kind.split(":")[1]][0]
            fields.append({"name": name, "type": {"type": "array", "items": item}})
            fields.append({"name": f"{name}_shape", "type": {"type": "array", "items": "long"}})
        else:
            fields.append({"name": name, "type": kind})
    return {"type": "record", "name": "Request", "namespace": "infer_worker", "fields": fields}


def _json(kinds: Mapping[str, str]) -> dict[str, Any]:
    string = {"type": ["string", "null"]}
    properties: dict[str, Any] = {
        "id": {"type": "string"}, "model": string, "model_version": string,
        "deadline_ms": {"type": ["integer", "null"]},
        "meta": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
    }  # fmt: skip
    for name, kind in kinds.items():
        if kind.startswith("array:"):
            item = _ITEMS[kind.split(":")[1]][1]
            properties[name] = {"type": "array", "items": {"type": item}}
            properties[f"{name}_shape"] = {"type": "array", "items": {"type": "integer"}}
        elif kind == "bytes":
            properties[name] = {"type": "string", "contentEncoding": "base64"}
        else:
            properties[name] = {"type": "string"}
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Request",
            "type": "object", "properties": properties, "required": ["id"]}  # fmt: skip


def _protobuf(kinds: Mapping[str, str]) -> str:
    from google.protobuf import descriptor_pb2

    from worker.contract.protobuf import serialized

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="request.proto", package="infer_worker",
                                             syntax="proto3")  # fmt: skip
    m = fdp.message_type.add(name="Request")
    entry = m.nested_type.add(name="MetaEntry")
    entry.options.map_entry = True
    for n, (key, kind) in enumerate((("key", f.TYPE_STRING), ("value", f.TYPE_STRING)), 1):
        entry.field.add(name=key, number=n, type=kind, label=f.LABEL_OPTIONAL)

    def add(name: str, kind: int, repeated: bool = False, type_name: str = "") -> None:
        field = m.field.add(name=name, number=len(m.field) + 1, type=kind,
                            label=f.LABEL_REPEATED if repeated else f.LABEL_OPTIONAL)
        if type_name:
            field.type_name = type_name

    add("id", f.TYPE_STRING)
    add("model", f.TYPE_STRING)
    add("model_version", f.TYPE_STRING)
    add("deadline_ms", f.TYPE_INT64)
    add("meta", f.TYPE_MESSAGE, True, ".infer_worker.Request.MetaEntry")
    for name, kind in kinds.items():
        if kind.startswith("array:"):
            add(name, _ITEMS[kind.split(":")[1]][2], True)
            add(f"{name}_shape", f.TYPE_INT64, True)
        else:
            add(name, f.TYPE_BYTES if kind == "bytes" else f.TYPE_STRING)
    return serialized(fdp)


_SCHEMAS: Final[dict[str, Callable[[Mapping[str, str]], Any]]] = {
    "avro": _avro, "jsonschema": _json, "protobuf": _protobuf,
}  # fmt: skip
