"""The operator's tools diagnose a connection as the worker does (issue 37):
``produce``, ``consume``, ``verify`` and ``compare`` against the secured Apache
Kafka (tests/faults/secured.py) with a wrong password, an untrusted CA, a
missing ACL, a protocol mismatch or no broker at all exit 2 with one line
naming the setting or permission to fix: no traceback, no aiokafka "Unclosed"
warnings, no secret."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.apache_kafka import KafkaCluster
from devkit.kafka_pki import Pki
from devkit.kafka_security import Acl, grant
from tests.documentation import documentation
from worker.ops.broker import create_topics
from worker.ops.samples import encode_samples, labelled_samples
from worker.ops.topics import Collector, produce_all

from .conftest import no_crash_in_log, request
from .secured import WORKER, assert_no_secret, client_env, spawn, topics, worker_security

pytestmark = pytest.mark.faults

CLIENT = "User:client"

# Each tool's command line, reading or writing the test's topics.
TOOLS = {
    "produce": ["produce", "--samples", "1", "--no-wait"],
    "consume": ["consume", "--timeout", "3"],
    "verify": ["verify", "--idle-timeout", "1", "--timeout", "20"],
    "compare": ["compare", "--baseline", "{results}", "--candidate", "{dlq}",
                "--idle-timeout", "1", "--timeout", "20"],
    "build-engine": ["build-engine", "builtin:digits", "--backend", "onnxruntime",
                     "--precision", "int8", "--out", "{out}", "--calibration-topic", "{requests}"],
}  # fmt: skip

# cause -> (settings over the client's SASL_SSL ones, the line's expected words)
CAUSES = {
    "wrong-password": ({"INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD": "not-it"},
                       "kafka.sasl_plain_username / sasl_plain_password: the broker at"),
    "untrusted-CA": ({"INFER_WORKER_KAFKA__SSL_CAFILE": "{stranger_ca}"},
                     "kafka.ssl_cafile: the broker's certificate at"),
    "missing-ACL": ({}, "is not allowed to use topic(s)"),
    "protocol-mismatch": ({"INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT"},
                          "speaks TLS: set security_protocol = SASL_SSL"),
    "no-broker": ({"INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:{closed}",
                   "INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "PLAINTEXT"},
                  "kafka.bootstrap_servers: no Kafka broker answers at 127.0.0.1:{closed}"),
}  # fmt: skip

# Every cause for produce and verify (a writer and a reader); the others the
# causes their own code paths could treat differently.
CASES = [
    *((tool, cause) for tool in ("produce", "verify") for cause in CAUSES),
    ("consume", "wrong-password"), ("consume", "missing-ACL"), ("consume", "no-broker"),
    ("compare", "untrusted-CA"), ("compare", "missing-ACL"), ("compare", "protocol-mismatch"),
    ("build-engine", "wrong-password"), ("build-engine", "missing-ACL"),
    ("build-engine", "no-broker"),
]  # fmt: skip


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("tool", "cause"), CASES, ids=[f"{t}-{c}" for t, c in CASES])
async def test_a_tool_names_what_to_fix_and_exits_2(
    secured: KafkaCluster,
    pki: Pki,
    names: dict[str, str],
    tool: str,
    cause: str,
    tmp_path: Path,
) -> None:
    await topics(secured, names)
    if cause != "missing-ACL":  # Describe only: the topics are seen, never read or written
        await grant(secured.bootstrap, [
            Acl(CLIENT, "Write", "topic", names["requests"]),
            *(Acl(CLIENT, "Read", "topic", names[t]) for t in ("requests", "results", "dlq")),
        ])  # fmt: skip
    else:
        await grant(secured.bootstrap, [
            Acl(CLIENT, "Describe", "topic", names[t]) for t in ("requests", "results", "dlq")
        ])  # fmt: skip
    fill = {"stranger_ca": pki.stranger_ca, "closed": closed_port(),
            "out": str(tmp_path / "digits-int8.onnx"), **names}  # fmt: skip
    overrides, expected = CAUSES[cause]
    env = client_env(secured, pki, names) | {
        "INFER_WORKER_KAFKA__REQUEST_TIMEOUT_MS": "5000",
        **{k: str(v).format(**fill) for k, v in overrides.items()},
    }
    argv = [a.format(**fill) for a in TOOLS[tool]]
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "worker", *argv], env=env, capture_output=True,
        text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert expected.format(**fill) in proc.stderr, out[-3000:]
    assert "Traceback" not in out and "Unclosed" not in out, out[-3000:]
    assert_no_secret(out)


# docs/guides/secure.md, the other principals: each tool with exactly its row.
SUFFICIENT = {
    "produce": (["produce", "--samples", "1", "--no-wait"], [("Write", "requests")]),
    "consume": (["consume", "--timeout", "2"], [("Read", "results"), ("Read", "dlq")]),
    "verify": (["verify", "--idle-timeout", "1", "--timeout", "20"],
               [("Read", "requests"), ("Read", "results"), ("Read", "dlq")]),
    "compare": (["compare", "--baseline", "{results}", "--candidate", "{dlq}",
                 "--idle-timeout", "1", "--timeout", "20"], [("Read", "results"), ("Read", "dlq")]),
    # An INT8 build calibrated on the requests topic (the bundled samples, put
    # there first by the cluster's super user).
    "build-engine": (["build-engine", "builtin:digits", "--backend", "onnxruntime",
                      "--precision", "int8", "--out", "{out}", "--calibration-topic",
                      "{requests}", "--calibration-count", "50"], [("Read", "requests")]),
}  # fmt: skip


@pytest.mark.parametrize("tool", list(SUFFICIENT))
async def test_a_tool_runs_with_exactly_the_acls_readme_lists_for_it(
    secured: KafkaCluster, pki: Pki, names: dict[str, str], tool: str, tmp_path: Path
) -> None:
    """Issue 37: the README's table of what each principal needs is enough: each
    tool, given exactly its row and nothing else, runs and exits 0."""
    await topics(secured, names)
    if tool == "build-engine":
        await produce_all(secured.bootstrap, names["requests"],
                          encode_samples(labelled_samples(1)[:60]))  # fmt: skip
    argv, grants = SUFFICIENT[tool]
    await grant(secured.bootstrap, [Acl(CLIENT, op, "topic", names[t]) for op, t in grants])
    fill = {**names, "out": str(tmp_path / "digits-int8.onnx")}
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "worker", *(a.format(**fill) for a in argv)],
        env=client_env(secured, pki, names), capture_output=True, text=True, timeout=120,
        check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr


def test_the_readme_lists_what_each_tool_is_run_with_here() -> None:
    readme = documentation()
    for row in (
        "| a producing client (`produce --no-wait`, your application) | Write | topic, each "
        "input topic it sends to |",
        "| `produce` waiting for answers, `consume`, `InferenceClient` | Read | topic "
        "`kafka.output_topic` (and `kafka.dlq_topic` for `consume`) |",
        "| `verify` | Read | every input topic, `kafka.output_topic`, `kafka.dlq_topic` |",
        "| `compare` | Read | both result topics (and `--input-topic` for labels) |",
        "| `build-engine --calibration-topic` | Read | that topic |",
        "| a shadow worker ([Rolling out a model safely](rollout.md)) | as "
        "the worker above, on its own group and output topic | no DLQ and no crash-guard "
        "topic: a shadow writes neither |",
    ):
        assert row in readme, row


async def test_a_shadow_runs_with_exactly_the_rows_readme_lists_for_it(
    secured: KafkaCluster, pki: Pki, names: dict[str, str]
) -> None:
    """README's shadow row, granted alone: Read on the input topic and on its own
    group, Write on its own result topic; no DLQ, no crash-guard topic (the
    production worker's guard topic exists and is configured: a shadow leaves it
    alone). It answers every request there and stops cleanly."""
    await topics(secured, names)
    shadow_out, shadow_group = f"{names['results']}.shadow", f"{names['group']}.shadow"
    await create_topics(secured.bootstrap, {shadow_out: 2})
    await grant(secured.bootstrap, [
        Acl(WORKER, "Read", "topic", names["requests"]),
        Acl(WORKER, "Read", "group", shadow_group),
        Acl(WORKER, "Write", "topic", shadow_out),
    ])  # fmt: skip
    await produce_all(secured.bootstrap, names["requests"], [(None, request(i)) for i in range(20)])
    answers = Collector(secured.bootstrap, [shadow_out])
    await answers.start()
    w = spawn(secured, names, worker_security(secured, pki, "SASL_SSL"),
              INFER_WORKER_KAFKA__SHADOW="true", INFER_WORKER_KAFKA__GROUP_ID=shadow_group,
              INFER_WORKER_KAFKA__OUTPUT_TOPIC=shadow_out)  # fmt: skip
    try:
        assert await answers.collect(lambda c: c.count() >= 20, 90), w.log_tail()
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        w.kill()
        await answers.stop()
    results = [r.result() for recs in answers.records.values() for r in recs]
    assert sorted(r.status for r in results) == ["ok"] * 20, [r.error for r in results]


@pytest.mark.parametrize("cause", ["wrong-password", "untrusted-CA", "protocol-mismatch"])
async def test_the_inference_client_names_what_to_fix(
    secured: KafkaCluster, pki: Pki, names: dict[str, str], cause: str
) -> None:
    """``InferenceClient.from_settings`` diagnoses its connection as the worker
    and the tools do: a ConfigError naming the setting, not "Unable to bootstrap"."""
    from worker.client import InferenceClient
    from worker.config import load_settings
    from worker.flow.errors import ConfigError

    await topics(secured, names)
    overrides, expected = CAUSES[cause]
    fill = {"stranger_ca": pki.stranger_ca, **names}
    env = client_env(secured, pki, names) | {
        "INFER_WORKER_KAFKA__REQUEST_TIMEOUT_MS": "5000",
        **{k: str(v).format(**fill) for k, v in overrides.items()},
    }
    client = InferenceClient.from_settings(load_settings(env=env).kafka)
    with pytest.raises(ConfigError) as raised:
        await client.start()
    assert expected.format(**fill) in str(raised.value)
    assert_no_secret(str(raised.value))
