"""Requests and results in the Schema Registry's Avro format (issue 67), with a
real registry (Apicurio's, ``devkit.schema_registry``) and on both brokers.

A client that is not ours does what a user's code would: confluent-kafka's
``SchemaRegistryClient`` and ``AvroSerializer`` register the request schema and
write the requests; its ``AvroDeserializer`` reads the worker's results with the
schema the worker registered. Every answer equals the model run alone on that
request: a two-input tensor model (arrays of floats and longs), the digits
model (PNG files as bytes, named by the request on the shared topic). The
request schema evolves while the worker runs (a field added with a default: v2
is read without a restart); a record naming a schema id the registry does not
have goes to the DLQ with the reason; msgpack requests on the same topic are
answered in msgpack as ever."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import confluent_kafka.schema_registry as sr
import numpy as np
import pytest
from confluent_kafka import serialization
from confluent_kafka.schema_registry import avro
from confluent_kafka.schema_registry import json_schema as js
from confluent_kafka.schema_registry import protobuf as pb

from devkit.schema_registry import SchemaRegistryServer
from tests.onnx_models import ranker, run_alone
from tests.serving import wire
from worker.config import ModelConfig
from worker.contract import Tensor
from worker.ops.broker import Broker, EmbeddedBroker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.samples import Sample, labelled_samples
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")

RANK_V1: dict[str, Any] = {
    "type": "record", "name": "RankRequest", "namespace": "shop", "fields": [
        {"name": "id", "type": "string"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
        {"name": "ids", "type": {"type": "array", "items": "long"}},
        {"name": "meta", "type": ["null", {"type": "map", "values": "string"}],
         "default": None},
    ],
}  # fmt: skip
# v2: a field added with a default, for another reader of the topic.
RANK_V2 = {**RANK_V1, "fields": [*RANK_V1["fields"],
                                  {"name": "channel", "type": "string", "default": "web"}]}
DIGITS: dict[str, Any] = {
    "type": "record", "name": "DigitRequest", "namespace": "shop", "fields": [
        {"name": "id", "type": "string"},
        {"name": "model", "type": ["null", "string"], "default": None},
        {"name": "image", "type": "bytes"},
    ],
}  # fmt: skip

CONFIG = """
[schema_registry]
url = "{url}"
[model]
path = "{ranker}"
[models.digits]
path = "builtin:digits"
"""


def _serializer(client: Any, schema: dict[str, Any]) -> Any:
    import json

    return avro.AvroSerializer(client, json.dumps(schema), conf={"auto.register.schemas": True})


def _digits_alone(samples: list[Sample]) -> list[int]:
    """The bundled digits model's top class of each sample, run directly."""
    from worker.compute.engines import load_engine
    from worker.model.inputs.image import resolve
    from worker.model.preprocess import preprocess

    cfg = ModelConfig()
    engine = load_engine(cfg)
    desc = engine.info.io.inputs[0]
    batch = preprocess([s.image for s in samples], resolve(cfg.preprocess, desc))
    logits = engine.run({desc.name: batch})[engine.info.output_names[0]]
    engine.close()
    return [int(i) for i in np.asarray(logits).argmax(axis=1)]


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image[:, :, 0]).save(out, format="PNG")
    return out.getvalue()


async def test_avro_requests_answered_in_avro_beside_msgpack(
    broker: Broker, names: dict[str, str], tmp_path: Path, schema_registry: SchemaRegistryServer
) -> None:
    rank_path = ranker(tmp_path / "ranker.onnx")
    config = tmp_path / "worker.toml"
    config.write_text(CONFIG.format(url=schema_registry.url, ranker=rank_path))
    topic, results_topic = names["requests"], names["results"]
    await create_topics(broker.bootstrap, {topic: 2, results_topic: 1, names["dlq"]: 1})
    client = sr.SchemaRegistryClient({"url": schema_registry.url})
    context = serialization.SerializationContext(topic, serialization.MessageField.VALUE)
    rng = np.random.default_rng(67)
    ranked = {f"r-{i}": (rng.normal(size=4).astype(np.float32),
                         rng.integers(1, 50, int(rng.integers(1, 9))).astype(np.int64))
              for i in range(30)}  # fmt: skip
    samples = labelled_samples(1)[:20]
    records: list[tuple[bytes, bytes]] = []
    for version, schema in ((0, RANK_V1), (1, RANK_V2)):
        serialize = _serializer(client, schema)
        for rid, (features, ids) in list(ranked.items())[version * 20 : 20 + version * 10]:
            value = {"id": rid, "features": features.tolist(), "ids": ids.tolist(),
                     "meta": {"shop": "7"}}  # fmt: skip
            records.append((rid.encode(), serialize(value, context)))
    digits = _serializer(sr.SchemaRegistryClient({"url": schema_registry.url}), DIGITS)
    # Another subject on the same topic (record name strategy in a user's producer is
    # theirs to choose; here the topic's subject holds the ranker's, so register apart).
    digits_context = serialization.SerializationContext(f"{topic}.digits",
                                                        serialization.MessageField.VALUE)
    for s in samples:
        value = {"id": f"d-{s.id}", "model": "digits", "image": _png(s.image)}
        records.append((f"d-{s.id}".encode(), digits(value, digits_context)))
    unknown = b"\x00" + (987_654).to_bytes(4, "big") + b"\x02\x04ab"
    records.append((b"unknown", unknown))
    features, ids = ranked["r-0"]
    records.append((b"m-0", wire("m-0", {"features": Tensor.from_numpy(features),
                                         "ids": Tensor.from_numpy(ids)})))  # fmt: skip
    w = spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=results_topic,
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(config)))  # fmt: skip
    c = Collector(broker.bootstrap, [results_topic, names["dlq"]])
    total = len(records)
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0, "assignment"
        )
        await produce_all(broker.bootstrap, topic, records)
        await c.start()
        assert await c.collect(lambda c: c.count() >= total, 90.0), w.log_tail()
    finally:
        await c.stop()
        assert w.terminate() == 0, w.log_tail()
    dlq = c.records.get(names["dlq"], [])
    assert [r.record_key for r in dlq] == [b"unknown"]
    reason = dlq[0].headers["error.message"].decode()
    assert "schema id 987654 is not in the schema registry" in reason, reason
    assert dlq[0].value == unknown  # the request's bytes, as sent
    read = avro.AvroDeserializer(sr.SchemaRegistryClient({"url": schema_registry.url}))
    out_context = serialization.SerializationContext(results_topic,
                                                     serialization.MessageField.VALUE)
    answers: dict[str, dict[str, Any]] = {}
    for r in c.records[results_topic]:
        if r.record_key == b"m-0":
            msgpack = r.result()  # the msgpack request: answered in msgpack
            alone = run_alone(rank_path, {"features": features, "ids": ids})["score"]
            np.testing.assert_allclose(msgpack.outputs["score"].to_numpy(), alone, rtol=1e-5,
                                       atol=1e-6)  # fmt: skip
            continue
        assert r.value[:1] == b"\x00", r.value[:20]
        answer = read(r.value, out_context)
        answers[answer["id"]] = answer
    assert len(answers) == len(ranked) + len(samples)
    for rid, (features, ids) in ranked.items():
        got = answers[rid]
        assert (got["status"], got["model"]["name"], got["error"]) == ("ok", "ranker", None)
        assert got["meta"] == {"shop": "7"}
        alone = run_alone(rank_path, {"features": features, "ids": ids})
        assert got["score"]["shape"] == [1]
        np.testing.assert_allclose(got["score"]["values"], alone["score"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["token_scores"]["values"], alone["token_scores"],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        assert got["topk_indices"] is None  # the digits model's outputs: not this answer's
    want = _digits_alone(samples)
    for s, label in zip(samples, want, strict=True):
        got = answers[f"d-{s.id}"]
        assert (got["status"], got["model"]["name"]) == ("ok", "digits"), got["error"]
        assert got["topk_indices"]["values"][0] == label
    # The tools read the Avro answers with the registry: verify finds every request
    # answered (the unknown id's in the DLQ), consume prints each result.
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    common = ["--bootstrap-servers", broker.bootstrap, "--schema-registry", schema_registry.url]
    verified = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "worker", "verify", *common, "--input-topics",
                         topic, "--output-topic", results_topic, "--dlq-topic", names["dlq"],
                         "--strict"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stdout + verified.stderr
    consumed = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "worker", "consume", *common, "--json",
                         "--timeout", "5"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**env, "INFER_WORKER_KAFKA__OUTPUT_TOPIC": results_topic,
             "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"]},
    )  # fmt: skip
    lines = [json.loads(line) for line in consumed.stdout.splitlines() if line.startswith("{")]
    assert {line["id"] for line in lines} == set(answers) | {"m-0"}, consumed.stderr[-2000:]


RANK_JSON: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#", "title": "RankRequest",
    "type": "object", "required": ["id", "features", "ids"], "properties": {
        "id": {"type": "string"},
        "features": {"type": "array", "items": {"type": "number"}},
        "ids": {"type": "array", "items": {"type": "integer"}},
        "note": {"type": ["string", "null"]},
    },
}  # fmt: skip


async def test_json_schema_requests_answered_in_json_schema(
    broker: Broker, names: dict[str, str], tmp_path: Path, schema_registry: SchemaRegistryServer
) -> None:
    """``formats = ["jsonschema"]``: JSON Schema requests (confluent-kafka's
    JSONSerializer) answered as JSON objects under the registered result schema
    (its JSONDeserializer reads them); a record its schema refuses is answered
    ``invalid_request`` naming the field; an Avro record goes to the DLQ saying the
    worker reads JSON Schema only."""
    import json

    rank_path = ranker(tmp_path / "ranker.onnx")
    config = tmp_path / "worker.toml"
    config.write_text(f'[schema_registry]\nurl = "{schema_registry.url}"\n'
                      f'formats = ["jsonschema"]\n[model]\npath = "{rank_path}"\n')
    topic, results_topic = names["requests"], names["results"]
    await create_topics(broker.bootstrap, {topic: 2, results_topic: 1, names["dlq"]: 1})
    client = sr.SchemaRegistryClient({"url": schema_registry.url})
    context = serialization.SerializationContext(topic, serialization.MessageField.VALUE)
    serialize = js.JSONSerializer(json.dumps(RANK_JSON), client)
    rng = np.random.default_rng(68)
    ranked = {f"j-{i}": (rng.normal(size=4).astype(np.float32),
                         rng.integers(1, 50, int(rng.integers(1, 9))).astype(np.int64))
              for i in range(20)}  # fmt: skip
    records = [(rid.encode(), serialize({"id": rid, "features": f.tolist(), "ids": i.tolist(),
                                         "note": None}, context))
               for rid, (f, i) in ranked.items()]  # fmt: skip
    # Valid JSON under the schema's id, but not what the schema allows.
    sid = int.from_bytes(records[0][1][1:5], "big")
    bad = b"\x00" + sid.to_bytes(4, "big") + b'{"id": "bad", "features": "x", "ids": [1]}'
    records.append((b"bad", bad))
    c = await _served_beside_an_avro_record(broker, names, config, client, records)
    (dlq,) = c.records[names["dlq"]]
    assert dlq.record_key == b"avro"
    assert "the worker reads ['jsonschema'] (schema_registry.formats)" in dlq.headers[
        "error.message"].decode()  # fmt: skip
    read = js.JSONDeserializer(None, schema_registry_client=client)
    out_context = serialization.SerializationContext(results_topic,
                                                     serialization.MessageField.VALUE)
    answers = {a["id"]: a for a in (read(r.value, out_context) for r in c.records[results_topic])}
    assert len(answers) == len(ranked) + 1
    for rid, (features, ids) in ranked.items():
        got = answers[rid]
        assert (got["status"], got["model"]["name"]) == ("ok", "ranker"), got["error"]
        alone = run_alone(rank_path, {"features": features, "ids": ids})
        np.testing.assert_allclose(got["score"]["values"], alone["score"], rtol=1e-5, atol=1e-6)
        assert got["token_scores"]["shape"] == [len(ids)]
    refused = answers["bad"]
    assert (refused["status"], refused["error"]["code"]) == ("error", "invalid_request")
    assert refused["error"]["message"].startswith("features: 'x' is not of type 'array'")


def _rank_message() -> Any:
    """A Protobuf request message made as an application's generated code would
    be, from its file descriptor (shop.RankRequest: id, features, ids)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="rank.proto", package="shop", syntax="proto3")
    m = fdp.message_type.add(name="RankRequest")
    m.field.add(name="id", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    m.field.add(name="features", number=2, type=f.TYPE_FLOAT, label=f.LABEL_REPEATED)
    m.field.add(name="ids", number=3, type=f.TYPE_INT64, label=f.LABEL_REPEATED)
    m.field.add(name="channel", number=4, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.RankRequest"))


async def test_protobuf_requests_answered_in_protobuf(
    broker: Broker, names: dict[str, str], tmp_path: Path, schema_registry: SchemaRegistryServer
) -> None:
    """``formats = ["protobuf"]``: Protobuf requests (confluent-kafka's
    ProtobufSerializer) answered with the result message the worker registers,
    read by its ProtobufDeserializer with a class made from that registered file;
    an Avro record goes to the DLQ."""
    from google.protobuf import descriptor_pool, message_factory

    from worker.contract.protobuf import descriptor_of

    rank_path = ranker(tmp_path / "ranker.onnx")
    config = tmp_path / "worker.toml"
    config.write_text(f'[schema_registry]\nurl = "{schema_registry.url}"\n'
                      f'formats = ["protobuf"]\n[model]\npath = "{rank_path}"\n')
    topic, results_topic = names["requests"], names["results"]
    await create_topics(broker.bootstrap, {topic: 2, results_topic: 1, names["dlq"]: 1})
    client = sr.SchemaRegistryClient({"url": schema_registry.url})
    context = serialization.SerializationContext(topic, serialization.MessageField.VALUE)
    message = _rank_message()
    serialize = pb.ProtobufSerializer(message, client, {"use.deprecated.format": False})
    rng = np.random.default_rng(69)
    ranked = {f"p-{i}": (rng.normal(size=4).astype(np.float32),
                         rng.integers(1, 50, int(rng.integers(1, 9))).astype(np.int64))
              for i in range(20)}  # fmt: skip
    records = [(rid.encode(), serialize(message(id=rid, features=f.tolist(), ids=i.tolist(),
                                                channel="app"), context))
               for rid, (f, i) in ranked.items()]  # fmt: skip
    c = await _served_beside_an_avro_record(broker, names, config, client, records)
    (dlq,) = c.records[names["dlq"]]
    assert dlq.record_key == b"avro"
    # The result message, as an application would generate it from the registered file.
    sid = int.from_bytes(c.records[results_topic][0].value[1:5], "big")
    fdp = descriptor_of(client.get_schema(sid).schema_str)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    result_class = message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"{fdp.package}.{fdp.message_type[0].name}"))
    read = pb.ProtobufDeserializer(result_class, {"use.deprecated.format": False})
    out_context = serialization.SerializationContext(results_topic,
                                                     serialization.MessageField.VALUE)
    answers = {a.id: a for a in (read(r.value, out_context) for r in c.records[results_topic])}
    assert set(answers) == set(ranked)
    for rid, (features, ids) in ranked.items():
        got = answers[rid]
        assert (got.status, got.model.name) == ("ok", "ranker"), got.error
        alone = run_alone(rank_path, {"features": features, "ids": ids})
        np.testing.assert_allclose(list(got.score.values), alone["score"], rtol=1e-5, atol=1e-6)
        assert list(got.token_scores.shape) == [len(ids)]
        assert got.source.topic == topic and got.timing_us["total"] > 0


async def test_produce_sends_each_format_and_reads_its_answers(
    embedded_broker: EmbeddedBroker, names: dict[str, str], tmp_path: Path,
    schema_registry: SchemaRegistryServer,
) -> None:  # fmt: skip
    """``produce --schema-registry``: the digits samples (pixels as integers, the
    image input's) in each format, the schema made from the first request and
    registered by the tool, every answer read back with the registry and ok
    (exit 0) from a worker answering all three formats."""
    topic, results_topic = names["requests"], names["results"]
    await create_topics(embedded_broker.bootstrap, {topic: 1, results_topic: 1, names["dlq"]: 1})
    config = tmp_path / "worker.toml"
    config.write_text(f'[schema_registry]\nurl = "{schema_registry.url}"\n'
                      'formats = ["avro", "jsonschema", "protobuf"]\n')  # fmt: skip
    w = spawn_worker(embedded_broker.bootstrap, input_topics=[topic], output_topic=results_topic,
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(config)))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    env |= {"INFER_WORKER_KAFKA__INPUT_TOPICS": topic,
            "INFER_WORKER_KAFKA__OUTPUT_TOPIC": results_topic}  # fmt: skip
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 1, 90.0, "assignment"
        )
        for fmt in ("avro", "jsonschema", "protobuf"):
            sent = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "worker", "produce", "--bootstrap-servers",
                                 embedded_broker.bootstrap, "--samples", "6", "--timeout", "60",
                                 "--json", "--schema-registry", schema_registry.url,
                                 "--schema-format", fmt],
                capture_output=True, text=True, timeout=120, env=env, check=False,
            )  # fmt: skip
            assert sent.returncode == 0, (fmt, sent.stdout[-2000:], sent.stderr[-2000:])
            answers = [json.loads(line) for line in sent.stdout.splitlines()
                       if line.startswith("{")]  # fmt: skip
            assert len(answers) == 6 and all(a["status"] == "ok" for a in answers), (fmt, answers)
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert not await _any_dlq(embedded_broker, names["dlq"])


async def _any_dlq(broker: Broker, dlq: str) -> bool:
    c = Collector(broker.bootstrap, [dlq])
    await c.start()
    try:
        await c.collect(lambda c: c.count() > 0, 2.0)
    finally:
        await c.stop()
    return c.count() > 0


@pytest.mark.parametrize("wire", ["avro", "jsonschema", "protobuf"])
async def test_the_python_client_in_each_registry_format(
    embedded_broker: EmbeddedBroker, names: dict[str, str], tmp_path: Path,
    schema_registry: SchemaRegistryServer, wire: str,
) -> None:  # fmt: skip
    """``InferenceClient(wire=FORMAT, schema_registry=...)``: requests of a
    two-input model in the format, each answer read back as the contract's
    Result, equal to the model alone."""
    from worker.client import InferenceClient
    from worker.config import SchemaRegistryConfig

    rank_path = ranker(tmp_path / "ranker.onnx")
    topic, results_topic = names["requests"], names["results"]
    await create_topics(embedded_broker.bootstrap, {topic: 1, results_topic: 1, names["dlq"]: 1})
    config = tmp_path / "worker.toml"
    config.write_text(f'[schema_registry]\nurl = "{schema_registry.url}"\nformats = ["{wire}"]\n'
                      f'[model]\npath = "{rank_path}"\n')  # fmt: skip
    w = spawn_worker(embedded_broker.bootstrap, input_topics=[topic], output_topic=results_topic,
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(config)))  # fmt: skip
    rng = np.random.default_rng(70)
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 1, 90.0, "assignment"
        )
        async with InferenceClient(
            embedded_broker.bootstrap, input_topic=topic, output_topic=results_topic,
            wire=wire, schema_registry=SchemaRegistryConfig(url=schema_registry.url),  # type: ignore[arg-type]
        ) as client:  # fmt: skip
            for _ in range(4):
                features = rng.normal(size=4).astype(np.float32)
                ids = rng.integers(1, 50, int(rng.integers(1, 6))).astype(np.int64)
                result = await client.infer(inputs={"features": features, "ids": ids},
                                            timeout=30)  # fmt: skip
                assert (result.status, result.model.name) == ("ok", "ranker"), result.error
                alone = run_alone(rank_path, {"features": features, "ids": ids})
                np.testing.assert_allclose(result.outputs["score"].to_numpy(), alone["score"],
                                           rtol=1e-5, atol=1e-6)  # fmt: skip
    finally:
        assert w.terminate() == 0, w.log_tail()


def test_compare_reads_a_label_from_a_registry_request(
    schema_registry: SchemaRegistryServer, tmp_path: Path
) -> None:
    """``compare --label-key`` on a topic of registry requests: each request's
    ``meta[label_key]`` read with the request schema of its id (here Avro)."""
    import fastavro

    from worker.config import SchemaRegistryConfig
    from worker.kafka.registry import SchemaRegistry
    from worker.kafka.registry_results import RegistryResults
    from worker.ops.compare.join import Comparison
    from worker.ops.compare.read import _Feed
    from worker.ops.topics import Collected

    cfg = SchemaRegistryConfig(url=schema_registry.url)
    sid = SchemaRegistry(cfg).register(f"labels-{tmp_path.name}-value", RANK_V1)
    out = io.BytesIO(b"\x00" + sid.to_bytes(4, "big"))
    out.seek(5)
    fastavro.schemaless_writer(out, fastavro.parse_schema(RANK_V1), {
        "id": "r", "features": [0.0] * 4, "ids": [1], "meta": {"label": "7"}})  # fmt: skip
    rec = Collected(b"r", out.getvalue(), {}, 0, 0, 0.0, 0, RegistryResults(cfg))
    feed = _Feed({"baseline": "b", "candidate": "c"}, Comparison(label_key="label"), "in",
                 "label", 1.0)  # fmt: skip
    assert feed._label(rec) == "7"


async def _served_beside_an_avro_record(
    broker: Broker, names: dict[str, str], config: Path, client: Any,
    records: list[tuple[bytes, bytes]],
) -> Collector:  # fmt: skip
    """``records`` and one Avro request (key ``avro``) served by a worker of
    ``config`` on two partitions; everything it wrote, once all is answered."""
    topic, results_topic = names["requests"], names["results"]
    avro_context = serialization.SerializationContext(f"{topic}.avro",
                                                      serialization.MessageField.VALUE)
    records = [*records, (b"avro", _serializer(client, RANK_V1)(
        {"id": "avro", "features": [0.0] * 4, "ids": [1], "meta": None}, avro_context))]
    w = spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=results_topic,
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(config)))  # fmt: skip
    c = Collector(broker.bootstrap, [results_topic, names["dlq"]])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0, "assignment"
        )
        await produce_all(broker.bootstrap, topic, records)
        await c.start()
        assert await c.collect(lambda c: c.count() >= len(records), 90.0), w.log_tail()
    finally:
        await c.stop()
        assert w.terminate() == 0, w.log_tail()
    return c
