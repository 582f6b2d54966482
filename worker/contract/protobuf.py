"""Requests and results in a Schema Registry's Protobuf wire format
(docs/guides/schema-registry.md): the framing and the fields' meaning are every
format's (``worker.contract.registered``); after the schema id, the message's
indexes in its file (Confluent's framing: a zigzag varint count, then each
index; a single 0 for the file's first message), then the message, read and
written by the ``protobuf`` library, never by hand.

A schema is read as the registry serves it to Confluent's clients with
``format=serialized``: a base64 ``FileDescriptorProto`` (what confluent-kafka's
Python serializer registers). A ``.proto`` text the registry does not serialize
is refused with the reason (no ``.proto`` compiler is bundled).

A field's type gives its input: a ``repeated`` ``float`` a float32 tensor,
``double`` float64, ``int32``/``sint32``/``sfixed32`` int32,
``int64``/``sint64``/``sfixed64``/``uint32`` int64, ``bool`` bool; ``bytes`` an
image file or a raw tensor; ``string`` a text. A result is the message
``RESULT`` of a file the worker registers (``result_schema``), with the Avro
result's fields.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

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
from worker.flow.errors import UndecodableRecord
from worker.flow.values import Result

_F = descriptor_pb2.FieldDescriptorProto
_ITEM_DTYPES: Final = {
    _F.TYPE_FLOAT: "float32", _F.TYPE_DOUBLE: "float64", _F.TYPE_INT32: "int32",
    _F.TYPE_SINT32: "int32", _F.TYPE_SFIXED32: "int32", _F.TYPE_INT64: "int64",
    _F.TYPE_SINT64: "int64", _F.TYPE_SFIXED64: "int64", _F.TYPE_UINT32: "int64",
    _F.TYPE_BOOL: "bool",
}  # fmt: skip
# A dtype's Protobuf type in results (wider where Protobuf has no narrower one).
_PROTO_OF: Final = {
    "float32": _F.TYPE_FLOAT, "float16": _F.TYPE_FLOAT, "float64": _F.TYPE_DOUBLE,
    "int64": _F.TYPE_INT64, "uint32": _F.TYPE_INT64, "int32": _F.TYPE_INT32,
    "int16": _F.TYPE_INT32, "int8": _F.TYPE_INT32, "uint16": _F.TYPE_INT32,
    "uint8": _F.TYPE_INT32, "bool": _F.TYPE_BOOL,
}  # fmt: skip


def descriptor_of(text: str) -> descriptor_pb2.FileDescriptorProto:
    """A registered schema's file descriptor; ``ValueError`` for what it cannot read."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
        return descriptor_pb2.FileDescriptorProto.FromString(raw)
    except (ValueError, UnicodeEncodeError, binascii.Error) as exc:
        raise ValueError("a .proto text the registry did not serialize (the worker reads "
                         "Protobuf schemas as a serialized FileDescriptorProto)") from exc
    except Exception as exc:  # boundary: protobuf's DecodeError
        raise ValueError(f"not a serialized FileDescriptorProto: {exc}") from exc


def _message_class(fdp: descriptor_pb2.FileDescriptorProto, full_name: str) -> Any:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _indexes(value: bytes) -> tuple[list[int], int]:
    """The message indexes after the schema id, and where the message starts."""
    at = HEADER_BYTES

    def varint() -> int:
        nonlocal at
        shift = result = 0
        while True:
            if at >= len(value):
                raise UndecodableRecord("truncated Protobuf message indexes")
            byte = value[at]
            at += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1)  # zigzag
            shift += 7

    count = varint()
    return ([varint() for _ in range(count)] if count else [0]), at


@dataclass(frozen=True)
class ProtobufRequestSchema:
    """A Protobuf request schema as the registry holds it, read once (by id)."""

    schema_id: int
    file: descriptor_pb2.FileDescriptorProto
    # message indexes -> its class and its repeated fields' names, made once
    classes: dict[tuple[int, ...], tuple[Any, frozenset[str]]]

    @property
    def format(self) -> Format:
        return "protobuf"

    @property
    def fields(self) -> Mapping[str, Field]:
        return self._fields((0,))

    @classmethod
    def of(cls, schema_id: int, text: str) -> ProtobufRequestSchema:
        fdp = descriptor_of(text)
        if not fdp.message_type:
            raise ValueError(f"schema {schema_id} has no message")
        return cls(schema_id, fdp, {})

    def _message(self, indexes: tuple[int, ...]) -> descriptor_pb2.DescriptorProto:
        try:
            message = self.file.message_type[indexes[0]]
            for i in indexes[1:]:
                message = message.nested_type[i]
        except IndexError as exc:
            raise UndecodableRecord(f"schema {self.schema_id} has no message {list(indexes)}"
                                    ) from exc  # fmt: skip
        return message

    def _fields(self, indexes: tuple[int, ...]) -> dict[str, Field]:
        out = {}
        for f in self._message(indexes).field:
            repeated = f.label == _F.LABEL_REPEATED
            if repeated and f.type in _ITEM_DTYPES:
                out[f.name] = Field("array", _ITEM_DTYPES[f.type])
            elif not repeated and f.type in (_F.TYPE_BYTES, _F.TYPE_STRING):
                out[f.name] = Field("bytes" if f.type == _F.TYPE_BYTES else "string")
            else:
                out[f.name] = Field("other")
        return out

    def read(self, value: bytes) -> dict[str, Any]:
        indexes, start = _indexes(value)
        key = tuple(indexes)
        if key not in self.classes:
            self._message(key)  # it exists
            names = [self.file.message_type[key[0]].name]
            m = self.file.message_type[key[0]]
            for i in key[1:]:
                m = m.nested_type[i]
                names.append(m.name)
            package = [self.file.package] if self.file.package else []
            repeated = frozenset(f.name for f in m.field if f.label == _F.LABEL_REPEATED)
            self.classes[key] = (_message_class(self.file, ".".join([*package, *names])),
                                 repeated)  # fmt: skip
        cls, repeated = self.classes[key]
        try:
            msg = cls.FromString(value[start:])
        except Exception as exc:  # boundary: protobuf's DecodeError
            raise UndecodableRecord(f"not a Protobuf message of schema {self.schema_id}: "
                                    f"{exc}") from exc  # fmt: skip
        return {fd.name: list(v) if fd.name in repeated else v for fd, v in msg.ListFields()}


# --- results -------------------------------------------------------------------


def result_schema(
    name: str, namespace: str, outputs: Mapping[str, OutputDesc]
) -> descriptor_pb2.FileDescriptorProto:
    """The result message's file (proto3; package ``namespace``) for answers
    carrying any of ``outputs``: the Avro result record's fields."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{name}.proto", package=namespace,
                                             syntax="proto3")  # fmt: skip
    top = fdp.message_type.add(name=name)

    def message(parent: Any, title: str, fields: list[tuple[str, int, bool, str]]) -> None:
        m = parent.nested_type.add(name=title)
        for number, (field, kind, repeated, type_name) in enumerate(fields, 1):
            f = m.field.add(name=field, number=number, type=kind,
                            label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if type_name:
                f.type_name = type_name

    def add(field: str, kind: int, type_name: str = "", repeated: bool = False) -> None:
        f = top.field.add(name=field, number=len(top.field) + 1, type=kind,
                          label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
        if type_name:
            f.type_name = f".{namespace}.{name}.{type_name}"

    s, i64, msg = _F.TYPE_STRING, _F.TYPE_INT64, _F.TYPE_MESSAGE
    message(top, "Model", [("name", s, False, ""), ("version", s, False, "")])
    message(top, "Error", [("code", s, False, ""), ("message", s, False, "")])
    message(top, "Source", [("topic", s, False, ""), ("partition", _F.TYPE_INT32, False, ""),
                            ("offset", i64, False, "")])  # fmt: skip
    message(top, "Failed", [("step", s, False, ""), ("code", s, False, ""),
                            ("message", s, False, "")])  # fmt: skip
    message(top, "Partial", [("skipped", s, True, ""),
                             ("failed", msg, True, f".{namespace}.{name}.Failed")])  # fmt: skip
    for entry, value in (("TimingUsEntry", i64), ("MetaEntry", s)):
        message(top, entry, [("key", s, False, ""), ("value", value, False, "")])
        top.nested_type[-1].options.map_entry = True
    for field, kind, type_name in (("v", _F.TYPE_INT32, ""), ("id", s, ""), ("status", s, ""),
                                   ("model", msg, "Model"), ("error", msg, "Error"),
                                   ("source", msg, "Source")):  # fmt: skip
        add(field, kind, type_name)
    add("timing_us", msg, "TimingUsEntry", repeated=True)
    add("meta", msg, "MetaEntry", repeated=True)
    add("partial", msg, "Partial")
    taken = {f.name for f in top.field}
    for output, desc in sorted(outputs.items()):
        key = field_name(output)
        if key in taken:
            raise ValueError(f"output {output!r}: its field {key!r} is taken")
        taken.add(key)
        kind = _PROTO_OF.get(desc[0]) if desc is not None else None
        values = ([("values", kind, True, "")] if kind is not None
                  else [("dtype", s, False, ""), ("data", _F.TYPE_BYTES, False, "")])  # fmt: skip
        message(top, f"Output_{key}", [("shape", i64, True, ""), *values])
        add(key, msg, f"Output_{key}")
    return fdp


def serialized(fdp: descriptor_pb2.FileDescriptorProto) -> str:
    """The schema as it is registered: a base64 serialized FileDescriptorProto."""
    return base64.b64encode(fdp.SerializeToString()).decode("ascii")


class ProtobufResults:
    """Results written as the registered result message (the file's first)."""

    def __init__(self, fdp: descriptor_pb2.FileDescriptorProto, registered_id: int) -> None:
        self.schema_id = registered_id
        top = fdp.message_type[0]
        self._cls = _message_class(fdp, f"{fdp.package}.{top.name}" if fdp.package else top.name)
        self._header = MAGIC + registered_id.to_bytes(4, "big") + b"\x00"  # message [0]
        self._typed = {
            f.name: any(x.name == "values" for x in m.field)
            for f in top.field for m in top.nested_type
            if f.type_name.endswith(f".{m.name}") and m.name.startswith("Output_")
        }  # fmt: skip

    def encode(self, result: Result, arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
        return self._write(result_record(result), outputs_of(result, arrays))

    def encode_ok(self, record: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
        return self._write(record, arrays)

    def _write(self, record: dict[str, Any], outputs: Mapping[str, Any]) -> bytes:
        for name in ("error", "partial", "meta"):
            if record[name] is None:
                del record[name]
        for output, given in outputs.items():
            key = field_name(output)
            typed = self._typed.get(key)
            if typed is not None:
                record[key] = output_value(given, typed)
        message: bytes = self._cls(**record).SerializeToString()
        return self._header + message
