"""The Schema Registry guide as written: its configuration (the broker's and the
registry's addresses and the topics swapped for the test's) served by a real
worker on Apache Kafka with a real registry, and its example script, run as a
process with confluent-kafka, prints one positive or negative answer a review,
each as the sentiment model gives it alone."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devkit.apache_kafka import KafkaCluster
from devkit.schema_registry import SchemaRegistryServer
from tests.documentation import ROOT
from tests.gpu.support import request_jobs
from tests.models import cpu_stage
from worker.config import LimitsConfig, ModelConfig
from worker.flow.messages import Batch
from worker.model.inputs import bind
from worker.ops.broker import create_topics
from worker.ops.processes import spawn_worker

pytestmark = pytest.mark.integration

PAGE = ROOT / "docs/guides/schema-registry.md"


def _block(kind: str) -> str:
    (found,) = re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), re.S)
    return str(found)


async def test_the_guides_configuration_and_example_run_as_written(
    kafka_broker: KafkaCluster, schema_registry: SchemaRegistryServer, tmp_path: Path,
    names: dict[str, str],
) -> None:  # fmt: skip
    requests, results = names["requests"], names["results"]
    config = (_block("toml")
              .replace('"localhost:9092"', f'"{kafka_broker.bootstrap}"')
              .replace('"http://localhost:8081"', f'"{schema_registry.url}"')
              .replace('"reviews.requests"', f'"{requests}"')
              .replace('"reviews.results"', f'"{results}"'))  # fmt: skip
    path = tmp_path / "worker.toml"
    path.write_text(config)
    script = tmp_path / "reviews.py"
    script.write_text(_block("python"))
    await create_topics(kafka_broker.bootstrap, {requests: 2, results: 1, names["dlq"]: 1})
    w = spawn_worker(kafka_broker.bootstrap, input_topics=[requests], output_topic=results,
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(path)))  # fmt: skip
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0, "assignment"
        )
        env = {**os.environ, "BOOTSTRAP": kafka_broker.bootstrap, "REGISTRY": schema_registry.url,
               "REQUESTS": requests, "RESULTS": results}  # fmt: skip
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, str(script)], env=env, capture_output=True,
            text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert done.returncode == 0, done.stderr[-3000:]
    listed = re.search(r"REVIEWS = (\[.*?\])\n", _block("python"))
    assert listed is not None
    reviews = ast.literal_eval(listed.group(1))
    want = [f"review-{i} ok {'positive' if logits[1] > logits[0] else 'negative'}"
            for i, logits in enumerate(await _alone(reviews))]  # fmt: skip
    assert sorted(done.stdout.split("\n")[:-1]) == want, (done.stdout, w.log_tail())


async def _alone(texts: list[str]) -> list[list[float]]:
    """The bundled sentiment model's logits for each text, on the CPU stage alone."""
    cfg = ModelConfig(path="builtin:sentiment")
    stage = cpu_stage(cfg)
    try:
        jobs = request_jobs(bind(cfg, stage.info.io, LimitsConfig()), [{"text": t} for t in texts])
        done = await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        stage.close()
    return [a.outputs["logits"].tolist() for a in done.answers]
