"""Exactly-once with Avro requests (issue 67): a worker reading requests in the
Schema Registry's format under ``processing_guarantee = "exactly-once"`` on
Apache Kafka, SIGKILLed mid-stream and restarted, answers each request exactly
once in Avro as read_committed readers see it, each answer the model's alone."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import fastavro
import numpy as np
import pytest

from devkit.schema_registry import SchemaRegistryServer
from tests.onnx_models import ranker, run_alone
from worker.config import SchemaRegistryConfig
from worker.kafka.registry import SchemaRegistry
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all

from .conftest import FAST_GROUP, no_crash_in_log, reads_more

pytestmark = pytest.mark.faults
pytest.importorskip("onnx")

PARTS, N = 2, 1200
SCHEMA = {
    "type": "record", "name": "RankRequest", "namespace": "shop", "fields": [
        {"name": "id", "type": "string"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
        {"name": "ids", "type": {"type": "array", "items": "long"}},
    ],
}  # fmt: skip


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_exactly_once_with_avro_across_a_sigkill(
    broker: Broker, names: dict[str, str], tmp_path: Path, schema_registry: SchemaRegistryServer
) -> None:
    rank_path = ranker(tmp_path / "ranker.onnx")
    topic, results = names["requests"], names["results"]
    await create_topics(broker.bootstrap, {topic: PARTS, results: PARTS, names["dlq"]: 1})
    registry = SchemaRegistry(SchemaRegistryConfig(url=schema_registry.url))
    sid = registry.register(f"{topic}-value", SCHEMA)
    parsed = fastavro.parse_schema(SCHEMA)
    rng = np.random.default_rng(11)
    requests: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    records: list[tuple[bytes, bytes]] = []
    for i in range(N):
        rid = f"r-{i}"
        features = rng.normal(size=4).astype(np.float32)
        ids = rng.integers(1, 50, int(rng.integers(1, 6))).astype(np.int64)
        requests[rid] = (features, ids)
        out = io.BytesIO(b"\x00" + sid.to_bytes(4, "big"))
        out.seek(5)
        fastavro.schemaless_writer(out, parsed, {"id": rid, "features": features.tolist(),
                                                 "ids": ids.tolist()})  # fmt: skip
        records.append((rid.encode(), out.getvalue()))
    config = tmp_path / "worker.toml"
    config.write_text(f'[schema_registry]\nurl = "{schema_registry.url}"\n'
                      f'[model]\npath = "{rank_path}"\n')  # fmt: skip
    env = {
        **FAST_GROUP,
        "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
        "INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS": "256",
        "INFER_WORKER_KAFKA__MAX_POLL_RECORDS": "100",
        "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "avro-1",  # the restart takes them back
    }

    def worker() -> WorkerProcess:
        return spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=results,
                            dlq_topic=names["dlq"], group_id=names["group"], extra_env=env,
                            command=("run", "--config", str(config)))  # fmt: skip

    w = worker()
    killed: WorkerProcess | None = None
    try:
        await asyncio.to_thread(w.wait_until, lambda m: m.get("infer_assigned_partitions", 0)
                                >= PARTS, 90.0, "assignment")  # fmt: skip
        producing = asyncio.ensure_future(produce_all(
            broker.bootstrap, topic, records, partition_of=lambda i: i % PARTS, rate=300))
        await reads_more(w, N // 3, within=30.0)
        w.kill()
        killed, w = w, worker()
        await producing
        c = Collector(broker.bootstrap, [results, names["dlq"]],
                      isolation_level="read_committed")  # fmt: skip
        await c.start()
        try:
            done = await c.collect(lambda c: c.count() >= N, 180.0)
            assert done, f"{c.count()} of {N} answered\n{w.log_tail()}"
            await asyncio.sleep(2.0)  # anything written twice would show by now
        finally:
            await c.stop()
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        for p in (w, killed):
            if p is not None:
                p.kill()
    assert not c.records.get(names["dlq"])
    result_sid = int.from_bytes(c.records[results][0].value[1:5], "big")
    reader = fastavro.parse_schema(json.loads(registry.schema(result_sid)[1]))
    answers = [fastavro.schemaless_reader(io.BytesIO(r.value[5:]), reader, None)
               for r in c.records[results]]  # fmt: skip
    sources = [(a["source"]["partition"], a["source"]["offset"]) for a in answers]
    assert len(sources) == len(set(sources)) == N, f"{len(sources) - len(set(sources))} twice"
    for a in answers[:: N // 50]:
        features, ids = requests[a["id"]]
        alone = run_alone(rank_path, {"features": features, "ids": ids})["score"]
        np.testing.assert_allclose(a["score"]["values"], alone, rtol=1e-5, atol=1e-6)
