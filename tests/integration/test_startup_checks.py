"""Settings that cannot work stop the worker at start-up with exit 2 and a message
naming the setting (issue 12), instead of a traceback or silent failures later."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.onnx_models import lying_output
from worker.ops.broker import Broker, create_topics

pytestmark = pytest.mark.integration


def run_worker(env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    return subprocess.run(
        [sys.executable, "-m", "worker", "run"],
        env={**base, "INFER_WORKER_LOGGING__FORMAT": "json", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def test_preprocess_size_that_contradicts_the_model_exits_2() -> None:
    """The bundled model takes 8x8; ``[28, 28]`` used to start and then fail every
    request after two attempts each. Checked before Kafka is even contacted."""
    proc = run_worker(
        {
            "INFER_WORKER_MODEL__PREPROCESS__SIZE": "[28, 28]",
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "INFER_WORKER_METRICS__PORT": "0",
        }
    )
    assert proc.returncode == 2, proc.stderr
    assert "model.preprocess.size" in proc.stderr
    assert "[batch, 1, 8, 8]" in proc.stderr and "[batch, 1, 28, 28]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_metrics_port_in_use_exits_2_naming_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_worker(
            {
                "INFER_WORKER_METRICS__PORT": str(port),
                "INFER_WORKER_METRICS__HOST": "127.0.0.1",
                "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
            }
        )
    assert proc.returncode == 2, proc.stderr
    assert "metrics.port" in proc.stderr and str(port) in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_missing_input_topic_exits_2_and_is_not_created(
    broker: Broker, names: dict[str, str]
) -> None:
    await create_topics(broker.bootstrap, {names["results"]: 1, names["dlq"]: 1})
    misspelt = names["requests"] + "-typo"
    proc = run_worker(
        {
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap,
            "INFER_WORKER_KAFKA__INPUT_TOPICS": misspelt,
            "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
            "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"],
            "INFER_WORKER_METRICS__PORT": "0",
        }
    )
    assert proc.returncode == 2, proc.stderr
    assert "kafka.input_topics" in proc.stderr and misspelt in proc.stderr
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        assert misspelt not in await admin.list_topics()
    finally:
        await admin.close()


@pytest.mark.parametrize(
    ("setting", "key"),
    [("kafka.output_topic", "results"), ("kafka.dlq_topic", "dlq"),
     ("kafka.crash_guard_topic", "guard")],
)  # fmt: skip
async def test_a_missing_output_dlq_or_named_crash_guard_topic_exits_2(
    broker: Broker, names: dict[str, str], setting: str, key: str
) -> None:
    """Issue 56: a misspelt output topic let the worker start, report ready and
    fail every delivery for a minute; each topic the worker writes is checked at
    start-up as the input topics are, naming the setting, the topic and what exists."""
    await create_topics(
        broker.bootstrap, {names[k]: 1 for k in ("requests", "results", "dlq", "guard")}
    )
    misspelt = names[key] + "-typo"
    env = {
        "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap,
        "INFER_WORKER_KAFKA__INPUT_TOPICS": names["requests"],
        "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
        "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"],
        "INFER_WORKER_KAFKA__CRASH_GUARD_TOPIC": names["guard"],
        "INFER_WORKER_METRICS__PORT": "0",
    }
    env[f"INFER_WORKER_KAFKA__{setting.split('.')[1].upper()}"] = misspelt
    proc = run_worker(env)
    assert proc.returncode == 2, proc.stderr
    line = f"{setting}: {misspelt} not found on {broker.bootstrap}"
    assert line in proc.stderr and names["requests"] in proc.stderr, proc.stderr
    assert "infer-worker topics create" in proc.stderr and "Traceback" not in proc.stderr


def test_a_broker_nothing_answers_at_exits_1_named_as_the_tools_name_it() -> None:
    """Issue 37: the worker says what the tools say (one line, naming
    kafka.bootstrap_servers), but exits 1: the broker may be starting, and a
    restart retries it (docs/guides/secure.md)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    proc = run_worker(
        {
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{closed}",
            "INFER_WORKER_KAFKA__REQUEST_TIMEOUT_MS": "3000",
            "INFER_WORKER_METRICS__PORT": "0",
        }
    )
    assert proc.returncode == 1, proc.stderr
    assert f"kafka.bootstrap_servers: no Kafka broker answers at 127.0.0.1:{closed}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_client_option_the_worker_owns_exits_2_naming_it() -> None:
    proc = run_worker(
        {
            "INFER_WORKER_KAFKA__CONSUMER_OPTIONS__ENABLE_AUTO_COMMIT": "true",
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "INFER_WORKER_METRICS__PORT": "0",
        }
    )
    assert proc.returncode == 2, proc.stderr
    assert "kafka.consumer_options.enable_auto_commit" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_nvjpeg_decoding_a_cpu_model_cannot_use_exits_2_before_the_engine_loads() -> None:
    """gpu.decode = "nvjpeg" with the CPU backend (which preprocesses on the host)
    would be silently ignored; it is refused, naming the setting, before the
    engine is loaded or Kafka contacted."""
    proc = run_worker(
        {
            "INFER_WORKER_GPU__DECODE": "nvjpeg",
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "INFER_WORKER_METRICS__PORT": "0",
        }
    )
    assert proc.returncode == 2, proc.stderr
    assert "gpu.decode" in proc.stderr and "model.preprocess.device" in proc.stderr
    assert "engine_loaded" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("broker_kind", ["embedded"])
async def test_exactly_once_exits_2_where_the_broker_has_no_transactions(
    broker: Broker, names: dict[str, str]
) -> None:
    """The embedded broker refuses a transactional producer (InitProducerId answers
    UNKNOWN): exactly-once cannot be had there, and the worker says so at
    start-up. (On Apache Kafka the same settings serve: tests/faults/test_exactly_once.py.)"""
    await create_topics(
        broker.bootstrap, {names["requests"]: 1, names["results"]: 1, names["dlq"]: 1}
    )
    proc = run_worker(
        {
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap,
            "INFER_WORKER_KAFKA__INPUT_TOPICS": names["requests"],
            "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
            "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"],
            "INFER_WORKER_KAFKA__GROUP_ID": names["group"],
            "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
            "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "w1",
            "INFER_WORKER_METRICS__PORT": "0",
        }
    )
    assert proc.returncode == 2, proc.stderr
    assert "kafka.processing_guarantee" in proc.stderr and "transactions" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_model_whose_output_breaks_its_declaration_exits_2_naming_it(tmp_path: Path) -> None:
    """Issue 37: the file declares y [1, seq] and returns [n, 2]; a run on zeros at
    start-up shows it before the worker joins its group (Kafka is never contacted)."""
    path = lying_output(tmp_path / "lying.onnx")
    proc = run_worker(
        {
            "INFER_WORKER_MODEL__PATH": str(path),
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "INFER_WORKER_METRICS__PORT": "0",
        }
    )
    assert proc.returncode == 2, proc.stderr
    assert "model.path" in proc.stderr and "output 'y'" in proc.stderr
    assert "[1, seq]" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("broker_kind", ["embedded"])
async def test_with_the_output_s_rows_configured_the_same_model_answers_as_alone(
    tmp_path: Path, broker: Broker, names: dict[str, str]
) -> None:
    """The model the test above refuses, with ``model.output_axes.y = "none"``
    (its output has no batch axis): the start-up probe passes and every request
    is answered exactly what the model returns for it alone (issue 37)."""
    import numpy as np
    import onnxruntime as ort

    from worker.contract import Request, Tensor, encode_request
    from worker.ops.processes import spawn_worker
    from worker.ops.topics import Collector, produce_all

    path = lying_output(tmp_path / "lying.onnx")
    await create_topics(broker.bootstrap, {names["requests"]: 1, names["results"]: 1,
                                           names["dlq"]: 1})  # fmt: skip
    rows = {f"r{n}": np.random.default_rng(n).normal(size=(n, 2)).astype(np.float32)
            for n in (2, 4, 7)}  # fmt: skip
    w = spawn_worker(
        broker.bootstrap, input_topics=[names["requests"]], output_topic=names["results"],
        dlq_topic=names["dlq"], group_id=names["group"],
        extra_env={"INFER_WORKER_MODEL__PATH": str(path),
                   "INFER_WORKER_MODEL__OUTPUT_AXES__Y": "none"},
    )  # fmt: skip
    c = Collector(broker.bootstrap, [names["results"]])
    try:
        await produce_all(broker.bootstrap, names["requests"], [
            (k.encode(), encode_request(Request(v=1, id=k, inputs={"x": Tensor.from_numpy(x)})))
            for k, x in rows.items()
        ])  # fmt: skip
        await c.start()
        assert await c.collect(lambda c: c.count() >= len(rows), 60.0), w.log_tail()
    finally:
        w.kill()
        await c.stop()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for rec in c.records[names["results"]]:
        result = rec.result()
        assert result.status == "ok", result.error
        (alone,) = session.run(["y"], {"x": rows[result.id][None]})
        np.testing.assert_array_equal(result.outputs["y"].to_numpy(), alone)
