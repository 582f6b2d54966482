"""The Schema Registry going away while the worker runs (issue 67), on both
brokers: requests of a schema the worker has seen keep being answered from its
cache; a request with an id it has not seen waits while the registry is asked
again with backoff, then goes to the DLQ naming the id and why (nothing lost);
the requests behind it are answered after it, in order."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import confluent_kafka.schema_registry as sr
import fastavro
import numpy as np
import pytest
from confluent_kafka import serialization
from confluent_kafka.schema_registry import avro

from devkit.schema_registry import SchemaRegistryServer
from tests.onnx_models import ranker, run_alone
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")

SCHEMA: dict[str, Any] = {
    "type": "record", "name": "RankRequest", "namespace": "shop", "fields": [
        {"name": "id", "type": "string"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
        {"name": "ids", "type": {"type": "array", "items": "long"}},
    ],
}  # fmt: skip
LATER = {**SCHEMA, "name": "RankRequestV2"}  # registered, but not seen by the worker before


def _requests(serialize: Any, context: Any, prefix: str, n: int,
              rng: np.random.Generator) -> dict[str, tuple[bytes, Any]]:  # fmt: skip
    out = {}
    for i in range(n):
        features = rng.normal(size=4).astype(np.float32)
        ids = rng.integers(1, 50, 3).astype(np.int64)
        value = serialize({"id": f"{prefix}-{i}", "features": features.tolist(),
                           "ids": ids.tolist()}, context)  # fmt: skip
        out[f"{prefix}-{i}"] = (value, (features, ids))
    return out


async def test_cached_schemas_serve_and_a_new_id_waits_then_goes_to_the_dlq(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    rank_path = ranker(tmp_path / "ranker.onnx")
    topic, results = names["requests"], names["results"]
    await create_topics(broker.bootstrap, {topic: 1, results: 1, names["dlq"]: 1})
    registry = SchemaRegistryServer().start()
    try:
        client = sr.SchemaRegistryClient({"url": registry.url})
        context = serialization.SerializationContext(topic, serialization.MessageField.VALUE)
        later = serialization.SerializationContext(f"{topic}.later",
                                                   serialization.MessageField.VALUE)
        rng = np.random.default_rng(3)
        conf = {"auto.register.schemas": True}
        known = avro.AvroSerializer(client, json.dumps(SCHEMA), conf=conf)
        unseen = avro.AvroSerializer(client, json.dumps(LATER), conf=conf)
        first = _requests(known, context, "a", 10, rng)
        during = _requests(known, context, "b", 10, rng)
        new = _requests(unseen, later, "n", 1, rng)
        after = _requests(known, context, "c", 10, rng)
        config = tmp_path / "worker.toml"
        config.write_text(f'[schema_registry]\nurl = "{registry.url}"\nlookup_timeout_ms = 3000\n'
                          f'request_timeout_ms = 500\n[model]\npath = "{rank_path}"\n')
        w = spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=results,
                         dlq_topic=names["dlq"], group_id=names["group"],
                         command=("run", "--config", str(config)))  # fmt: skip
        c = Collector(broker.bootstrap, [results, names["dlq"]])
        await c.start()
        try:
            await asyncio.to_thread(w.wait_until,
                                    lambda m: m.get("infer_assigned_partitions", 0) >= 1, 90.0,
                                    "assignment")  # fmt: skip
            await produce_all(broker.bootstrap, topic,
                              [(k.encode(), v) for k, (v, _) in first.items()])  # fmt: skip
            assert await c.collect(lambda c: c.count() >= 10, 60.0), w.log_tail()
            # The worker's result schema, read while the registry is there.
            sid = int.from_bytes(c.records[results][0].value[1:5], "big")
            result_schema = json.loads(client.get_schema(sid).schema_str)
        finally:
            registry.stop()  # the registry goes away; the worker has seen one schema
        try:
            records = [*during.items(), *new.items(), *after.items()]
            await produce_all(broker.bootstrap, topic, [(k.encode(), v) for k, (v, _) in records])
            assert await c.collect(lambda c: c.count() >= 31, 60.0), w.log_tail()
        finally:
            await c.stop()
            assert w.terminate() == 0, w.log_tail()
    finally:
        registry.stop()
    dlq = c.records.get(names["dlq"], [])
    assert [r.record_key for r in dlq] == [b"n-0"]
    reason = dlq[0].headers["error.message"].decode()
    assert "the schema registry did not answer for 3s" in reason, reason
    answered = c.records[results]
    keys = [r.record_key.decode() for r in answered if r.record_key]
    # One partition: answered in order, the new id's request between b and c.
    assert keys == [*first, *during, *after], keys
    assert dlq[0].headers["source.offset"] == b"20"  # the request between b-9 and c-0
    parsed = fastavro.parse_schema(result_schema)
    for r in answered:
        got = fastavro.schemaless_reader(io.BytesIO(r.value[5:]), parsed, None)
        features, ids = {**first, **during, **after}[got["id"]][1]
        assert (r.value[:5], got["status"]) == (b"\x00" + sid.to_bytes(4, "big"), "ok")
        alone = run_alone(rank_path, {"features": features, "ids": ids})["score"]
        np.testing.assert_allclose(got["score"]["values"], alone, rtol=1e-5, atol=1e-6)
