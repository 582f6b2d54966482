"""Avro requests and results (``worker.contract.avro``) without a broker: a
record's fields mapped onto a model's inputs (arrays and their shapes, bytes
as image files or raw tensors, texts, the request's own fields, fields for
other readers left alone, a field that fits no input refused naming it); the
result schema made from the outputs and what results encode to, read back by
fastavro with the schema alone; and the registry client's answers (a schema it
does not have, a registry that does not answer) from real sockets."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import fastavro
import numpy as np
import pytest

from worker.config import SchemaRegistryConfig
from worker.contract.avro import AvroResults, WriterSchema, result_schema
from worker.contract.registered import InputsView, field_name, request_of, schema_id
from worker.flow.errors import ConfigError, InvalidRequest, UndecodableRecord
from worker.flow.values import EncodedImage, ErrorInfo, ModelInfo, Result, Source, Tensor
from worker.kafka.registry import SchemaRegistry, Schemas
from worker.ops.broker import free_port

SCHEMA: dict[str, Any] = {
    "type": "record", "name": "Req", "fields": [
        {"name": "id", "type": "string"},
        {"name": "model", "type": ["null", "string"], "default": None},
        {"name": "deadline_ms", "type": ["null", "long"], "default": None},
        {"name": "meta", "type": ["null", {"type": "map", "values": "string"}], "default": None},
        {"name": "x", "type": {"type": "array", "items": "float"}},
        {"name": "x_shape", "type": ["null", {"type": "array", "items": "long"}],
         "default": None},
        {"name": "grid", "type": ["null", {"type": "array", "items": {
            "type": "array", "items": "int"}}], "default": None},
        {"name": "raw", "type": ["null", "bytes"], "default": None},
        {"name": "text", "type": ["null", "string"], "default": None},
        {"name": "channel", "type": "string", "default": "web"},
    ],
}  # fmt: skip
TAKES = InputsView(frozenset({"x", "grid", "raw", "text", "photo"}), frozenset({"photo"}),
                   {"raw": ("int16", (2, 2)), "x": ("float32", (2, 3))})  # fmt: skip


def _encoded(record: dict[str, Any], sid: int = 7, schema: dict[str, Any] = SCHEMA) -> bytes:
    out = io.BytesIO()
    out.write(b"\x00" + sid.to_bytes(4, "big"))
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def _request(record: dict[str, Any]) -> Any:
    schema = WriterSchema.of(7, json.dumps(SCHEMA))
    return request_of(schema.read(_encoded(record)), schema, TAKES)


def test_fields_become_the_models_inputs() -> None:
    raw = np.arange(4, dtype="<i2").reshape(2, 2)
    req = _request({"id": "r1", "model": "m", "deadline_ms": 123, "meta": {"a": "b"},
                    "x": [1, 2, 3, 4, 5, 6], "grid": [[1, 2], [3, 4]], "raw": raw.tobytes(),
                    "text": "hello", "channel": "app"})  # fmt: skip
    assert (req.id, req.model.name, req.deadline_ms, req.meta) == ("r1", "m", 123, {"a": "b"})
    x = req.inputs["x"]  # an array; flat: the input's fixed shape
    assert (x.dtype, x.shape) == (np.float32, (2, 3)) and x[1, 2] == 6
    grid = req.inputs["grid"]  # nested: its own shape, the item type's dtype
    assert (grid.dtype, grid.tolist()) == (np.int32, [[1, 2], [3, 4]])
    np.testing.assert_array_equal(req.inputs["raw"].to_numpy(), raw)  # bytes: raw tensor
    assert req.inputs["text"] == "hello"
    assert "channel" not in req.inputs  # another reader's field: left alone


def test_a_shape_field_shapes_a_flat_array() -> None:
    req = _request({"id": "r", "x": [1, 2, 3, 4, 5, 6], "x_shape": [3, 2]})
    assert req.inputs["x"].shape == (3, 2)


def test_bytes_for_an_image_input_are_its_file() -> None:
    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (4, 4)).save(out, format="PNG")
    schema = {"type": "record", "name": "P", "fields": [
        {"name": "id", "type": "string"}, {"name": "photo", "type": "bytes"}]}  # fmt: skip
    parsed = WriterSchema.of(3, json.dumps(schema))
    req = request_of(parsed.read(_encoded({"id": "p", "photo": out.getvalue()}, 3, schema)),
                     parsed, TAKES)  # fmt: skip
    assert isinstance(req.inputs["photo"], EncodedImage) and req.inputs["photo"].format == "png"


def test_a_field_that_fits_no_input_is_an_invalid_request_naming_it() -> None:
    with pytest.raises(InvalidRequest, match=r"inputs.raw: .*") as refused:
        _request({"id": "r9", "x": [1.0] * 6, "raw": b"\x00\x01\x02"})  # 3 bytes for int16 [2, 2]
    assert refused.value.request_id == "r9"
    with pytest.raises(InvalidRequest, match=r"inputs.x: "):
        _request({"id": "r9", "x": [1.0] * 5, "x_shape": [2, 3]})


def test_a_record_that_is_not_one_of_its_schema_is_undecodable() -> None:
    schema = WriterSchema.of(7, json.dumps(SCHEMA))
    with pytest.raises(UndecodableRecord, match="not an Avro record of schema 7"):
        schema.read(b"\x00\x00\x00\x00\x07\xff")
    with pytest.raises(UndecodableRecord, match="no string field id"):
        nameless = {"type": "record", "name": "N", "fields": [{"name": "x", "type": "int"}]}
        parsed = WriterSchema.of(8, json.dumps(nameless))
        request_of(parsed.read(_encoded({"x": 1}, 8, nameless)), parsed, TAKES)
    with pytest.raises(ValueError, match="not an Avro record"):
        WriterSchema.of(9, '"string"')
    assert schema_id(b"\x00\x00\x00\x01\x00rest") == 256 and schema_id(b"\x81\xa1v") is None


def test_results_encode_to_the_schema_made_from_the_outputs() -> None:
    outputs = {"topk_indices": ("int64", (3,)), "score": ("float32", (1,)), "odd-name": None}
    schema = result_schema("InferenceResult", "infer_worker", outputs)
    results = AvroResults(schema, 42)
    result = Result(
        id="r1", status="ok", source=Source("in", 1, 9), model=ModelInfo("m", "v1"),
        outputs={"topk_indices": Tensor.from_numpy(np.array([4, 2, 0])),
                 "odd-name": Tensor.from_numpy(np.array([[1, 2]], dtype=np.uint8))},
        meta={"k": "v"}, timing_us={"total": 10},
    )  # fmt: skip
    value = results.encode(result)
    assert value[:5] == b"\x00\x00\x00\x00\x2a"
    back = fastavro.schemaless_reader(io.BytesIO(value[5:]), fastavro.parse_schema(schema), None)
    assert back["topk_indices"] == {"shape": [3], "values": [4, 2, 0]}
    assert back["score"] is None  # not this answer's
    assert back[field_name("odd-name")] == {"shape": [1, 2], "dtype": "uint8", "data": b"\x01\x02"}
    assert (back["id"], back["status"], back["meta"], back["error"]) == ("r1", "ok", {"k": "v"},
                                                                         None)  # fmt: skip
    partial = Result(id="r2", status="ok", source=Source("in", 0, 1), model=ModelInfo("p", "1"),
                     partial={"skipped": ["rank"], "failed": [
                         {"step": "check", "code": "inference_failed", "message": "no"}]})
    back = fastavro.schemaless_reader(io.BytesIO(results.encode(partial)[5:]),
                                      fastavro.parse_schema(schema), None)  # fmt: skip
    assert back["partial"] == {"skipped": ["rank"], "failed": [
        {"step": "check", "code": "inference_failed", "message": "no"}]}  # fmt: skip
    with pytest.raises(ValueError, match="is taken"):
        result_schema("R", "n", {"a-b": None, "a_b": None})


def test_a_schema_the_registry_does_not_have_and_one_it_cannot_be_asked_for() -> None:
    """No registry listens on the port: asked again with backoff for the lookup
    time, then the record's answer names the id and why; asked again next time."""
    cfg = SchemaRegistryConfig(url=f"http://127.0.0.1:{free_port()}", request_timeout_ms=200)
    schemas = Schemas(SchemaRegistry(cfg), lookup_timeout_s=0.6)
    value = b"\x00" + (5).to_bytes(4, "big") + b"\x02"
    started = time.monotonic()
    asyncio.run(schemas.ready(value))
    waited = time.monotonic() - started
    assert 0.6 <= waited < 0.6 + 0.2 + 1.0  # the lookup time (a last try at its end), no more
    with pytest.raises(UndecodableRecord, match="schema id 5: the schema registry did not answer"):
        schemas.get(5)
    with pytest.raises(UndecodableRecord, match="not looked up"):
        schemas.get(5)  # the failure was this record's; the next one asks again
    asyncio.run(schemas.ready(b"\x81\xa1v"))  # not the registry's format: nothing asked


def test_registry_settings_are_checked_and_the_password_never_shown() -> None:
    cfg = SchemaRegistryConfig(url="https://r:8081", username="u", password="s3cret")  # type: ignore[arg-type]
    assert "s3cret" not in repr(cfg) and cfg.subject("out") == "out-value"
    assert SchemaRegistryConfig(url="http://r", subject_strategy="topic_record").subject(
        "out") == "out-infer_worker.InferenceResult"  # fmt: skip
    with pytest.raises(ConfigError, match=r"schema_registry\.url"):
        SchemaRegistryConfig(url="r:8081")
    with pytest.raises(ConfigError, match=r"schema_registry\.password: needs"):
        SchemaRegistryConfig(url="http://r", password="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"schema_registry\.result_name"):
        SchemaRegistryConfig(result_name="not-a-name")


def test_json_schema_requests_and_results() -> None:
    """JSON Schema: properties by type (nullable, base64 bytes), a record its
    schema refuses answered naming the field, and every result valid under the
    result schema made for it."""
    import base64

    import jsonschema

    from worker.contract.json_schema import JsonRequestSchema, JsonResults
    from worker.contract.json_schema import result_schema as json_result_schema

    schema = {"type": "object", "required": ["id"], "properties": {
        "id": {"type": "string"},
        "x": {"type": ["array", "null"], "items": {"type": "number"}},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "raw": {"anyOf": [{"type": "null"}, {"type": "string", "contentEncoding": "base64"}]},
        "text": {"type": "string"}}}  # fmt: skip
    parsed = JsonRequestSchema.of(4, json.dumps(schema))
    raw = np.arange(4, dtype="<i2").reshape(2, 2)
    record = {"id": "j1", "x": [1, 2, 3, 4, 5, 6], "grid": [[1, 2]], "text": "hi",
              "raw": base64.b64encode(raw.tobytes()).decode()}  # fmt: skip
    value = b"\x00\x00\x00\x00\x04" + json.dumps(record).encode()
    req = request_of(parsed.read(value), parsed, TAKES)
    assert req.inputs["x"].dtype == np.float32
    assert req.inputs["x"].shape == (2, 3)
    assert req.inputs["grid"].dtype == np.int64
    np.testing.assert_array_equal(req.inputs["raw"].to_numpy(), raw)
    assert req.inputs["text"] == "hi" and parsed.format == "jsonschema"
    with pytest.raises(InvalidRequest, match=r"grid\.0: 'a' is not of type 'array'") as refused:
        parsed.read(b"\x00\x00\x00\x00\x04" + b'{"id": "j2", "grid": ["a"]}')
    assert refused.value.request_id == "j2"
    outputs = {"score": ("float32", (1,)), "blob": None}
    made = json_result_schema("InferenceResult", "infer_worker", outputs)
    results = JsonResults(made, 9)
    ok = Result(id="j1", status="ok", source=Source("in", 0, 3), model=ModelInfo("m", "1"),
                outputs={"score": Tensor.from_numpy(np.array([0.25], np.float32)),
                         "blob": Tensor.from_numpy(np.array([7], np.uint8))})  # fmt: skip
    err = Result(id="j2", status="error", source=Source("in", 0, 4), model=ModelInfo("m", "1"),
                 error=ErrorInfo("invalid_request", "no"))  # fmt: skip
    for result in (ok, err):
        encoded = results.encode(result)
        assert encoded[:5] == b"\x00\x00\x00\x00\x09"
        jsonschema.validate(json.loads(encoded[5:]), made)
    back = json.loads(results.encode(ok)[5:])
    assert back["score"] == {"shape": [1], "values": [0.25]}
    assert base64.b64decode(back["blob"]["data"]) == b"\x07"


def test_protobuf_requests_and_results() -> None:
    """Protobuf: a request message found by its indexes (a nested one too), its
    repeated fields as arrays; a result written as the registered message and
    read back by a class made from the same file."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from worker.contract.protobuf import (
        ProtobufRequestSchema,
        ProtobufResults,
        descriptor_of,
        serialized,
    )
    from worker.contract.protobuf import result_schema as proto_result_schema

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="r.proto", package="p", syntax="proto3")
    outer = fdp.message_type.add(name="Outer")
    inner = outer.nested_type.add(name="Req")
    inner.field.add(name="id", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    inner.field.add(name="x", number=2, type=f.TYPE_FLOAT, label=f.LABEL_REPEATED)
    inner.field.add(name="text", number=3, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    req_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("p.Outer.Req"))
    schema = ProtobufRequestSchema.of(12, serialized(fdp))
    # Indexes [0, 0]: zigzag varints 2 (count), 0, 0.
    value = b"\x00\x00\x00\x00\x0c\x04\x00\x00" + req_class(
        id="q1", x=[1, 2, 3, 4, 5, 6], text="hey").SerializeToString()
    record = schema.read(value)
    assert record == {"id": "q1", "x": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "text": "hey"}
    with pytest.raises(UndecodableRecord, match=r"schema 12 has no message \[3\]"):
        schema.read(b"\x00\x00\x00\x00\x0c\x02\x06")
    with pytest.raises(ValueError, match=r"a \.proto text"):
        descriptor_of('syntax = "proto3"; message A { string id = 1; }')
    made = proto_result_schema("InferenceResult", "infer_worker",
                               {"score": ("float32", (1,)), "blob": None})  # fmt: skip
    results = ProtobufResults(made, 21)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_of(serialized(made)))
    result_class = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("infer_worker.InferenceResult"))
    ok = Result(id="r", status="ok", source=Source("in", 1, 2), model=ModelInfo("m", "1"),
                outputs={"score": Tensor.from_numpy(np.array([0.5], np.float32)),
                         "blob": Tensor.from_numpy(np.array([9], np.uint8))},
                meta={"k": "v"}, timing_us={"total": 4})  # fmt: skip
    encoded = results.encode(ok)
    assert encoded[:6] == b"\x00\x00\x00\x00\x15\x00"
    back = result_class.FromString(encoded[6:])
    assert (back.id, back.status, list(back.score.values), back.blob.data) == (
        "r", "ok", [0.5], b"\x09")  # fmt: skip
    assert dict(back.meta) == {"k": "v"} and back.timing_us["total"] == 4
    err = Result(id="e", status="error", source=Source("in", 1, 3), model=ModelInfo("m", "1"),
                 error=ErrorInfo("invalid_request", "bad"))  # fmt: skip
    back = result_class.FromString(results.encode(err)[6:])
    assert (back.error.code, back.HasField("score")) == ("invalid_request", False)


def test_a_codec_failure_on_a_record_goes_to_the_dlq_not_the_worker() -> None:
    """Whatever a registry format's library raises on a client's bytes becomes
    the record's DLQ reason (the intake never raises)."""
    from worker.config import LimitsConfig
    from worker.kafka.intake import JobFactory
    from worker.model.inputs import ModelInputs

    class Breaks:
        schema_id = 3
        format = "protobuf"
        fields: Mapping[str, Any] = MappingProxyType({})

        def read(self, value: bytes) -> dict[str, Any]:
            raise AttributeError("a library's bug")

    cfg = SchemaRegistryConfig(url="http://127.0.0.1:1")
    schemas = Schemas(SchemaRegistry(cfg), 0.0)
    schemas._known[3] = Breaks()  # type: ignore[assignment]
    make = JobFactory(ModelInputs([]), LimitsConfig(), model="m", schemas=schemas)
    job = make("t", 0, 5, None, b"\x00\x00\x00\x00\x03\x00\x01", 0)
    assert isinstance(job.failure, UndecodableRecord)
    assert "schema 3: AttributeError: a library's bug" in str(job.failure)
