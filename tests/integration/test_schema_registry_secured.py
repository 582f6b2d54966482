"""A secured Schema Registry (issue 67): HTTPS with a private certificate
authority and basic auth in front of the real registry (``devkit.schema_registry
.SecuredFront``). The worker verifies the registry against ``ca_file``, sends
the credentials, and serves Avro requests through it; a wrong password stops
start-up with exit 2 naming the setting; the password appears in no log line
and no printed configuration."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import fastavro
import numpy as np
import pytest

from devkit.kafka_pki import make_pki
from devkit.schema_registry import SchemaRegistryServer, SecuredFront
from tests.onnx_models import ranker, run_alone
from worker.config import SchemaRegistryConfig
from worker.kafka.registry import SchemaRegistry
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")

PASSWORD = "s3cret-registry-pass"
SCHEMA = {"type": "record", "name": "Rank", "fields": [
    {"name": "id", "type": "string"},
    {"name": "features", "type": {"type": "array", "items": "float"}},
    {"name": "ids", "type": {"type": "array", "items": "long"}}]}  # fmt: skip


async def test_a_registry_behind_tls_and_basic_auth(
    embedded_broker: EmbeddedBroker, schema_registry: SchemaRegistryServer,
    names: dict[str, str], tmp_path: Path,
) -> None:  # fmt: skip
    pki = make_pki(tmp_path / "pki", ())
    front = SecuredFront(schema_registry.url, pki.broker_keystore, "worker", PASSWORD)
    try:
        rank_path = ranker(tmp_path / "ranker.onnx")
        topic, results = names["requests"], names["results"]
        await create_topics(embedded_broker.bootstrap, {topic: 1, results: 1, names["dlq"]: 1})
        secured = SchemaRegistryConfig(
            url=front.url, username="worker", password=PASSWORD,  # type: ignore[arg-type]
            ca_file=str(pki.ca),
        )
        sid = SchemaRegistry(secured).register(f"{topic}-value", SCHEMA)
        parsed = fastavro.parse_schema(SCHEMA)
        rng = np.random.default_rng(5)
        requests = {}
        records = []
        for i in range(10):
            features = rng.normal(size=4).astype(np.float32)
            ids = rng.integers(1, 50, 3).astype(np.int64)
            requests[f"s-{i}"] = (features, ids)
            out = io.BytesIO(b"\x00" + sid.to_bytes(4, "big"))
            out.seek(5)
            fastavro.schemaless_writer(out, parsed, {"id": f"s-{i}", "features": features.tolist(),
                                                     "ids": ids.tolist()})  # fmt: skip
            records.append((f"s-{i}".encode(), out.getvalue()))

        def config(password: str) -> Path:
            path = tmp_path / f"worker-{password[:4]}.toml"
            path.write_text(f'[schema_registry]\nurl = "{front.url}"\nusername = "worker"\n'
                            f'password = "{password}"\nca_file = "{pki.ca}"\n'
                            f'[model]\npath = "{rank_path}"\n')  # fmt: skip
            return path

        env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
        refused = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "worker", "config", "--config",
                             str(config("wrong-password"))],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "schema_registry.url: registering the avro result schema" in refused.stderr
        assert "401" in refused.stderr and "wrong-password" not in refused.stderr
        shown = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "worker", "config", "--config",
                             str(config(PASSWORD))],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr[-2000:]
        assert '"password": "***"' in shown.stdout and PASSWORD not in shown.stdout
        w = spawn_worker(embedded_broker.bootstrap, input_topics=[topic], output_topic=results,
                         dlq_topic=names["dlq"], group_id=names["group"],
                         command=("run", "--config", str(config(PASSWORD))))  # fmt: skip
        c = Collector(embedded_broker.bootstrap, [results, names["dlq"]])
        try:
            await asyncio.to_thread(w.wait_until,
                                    lambda m: m.get("infer_assigned_partitions", 0) >= 1, 90.0,
                                    "assignment")  # fmt: skip
            await produce_all(embedded_broker.bootstrap, topic, records)
            await c.start()
            assert await c.collect(lambda c: c.count() >= len(records), 60.0), w.log_tail()
        finally:
            await c.stop()
            assert w.terminate() == 0, w.log_tail()
        assert not c.records.get(names["dlq"])
        assert PASSWORD not in w.log_tail(10_000)
        reader = SchemaRegistry(secured)  # the answers' schema, through the secured front
        result_sid = int.from_bytes(c.records[results][0].value[1:5], "big")
        result_schema = fastavro.parse_schema(json.loads(reader.schema(result_sid)[1]))
        for r in c.records[results]:
            got = fastavro.schemaless_reader(io.BytesIO(r.value[5:]), result_schema, None)
            features, ids = requests[got["id"]]
            alone = run_alone(rank_path, {"features": features, "ids": ids})["score"]
            np.testing.assert_allclose(got["score"]["values"], alone, rtol=1e-5, atol=1e-6)
        assert front.seen >= 3  # the result schema registered, the request schema read
    finally:
        front.stop()
