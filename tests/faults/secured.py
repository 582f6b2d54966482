"""A secured Apache Kafka for the fault tests (issue 29's, shared): the
principals' passwords, the worker's ACLs, and a worker's or a tool's settings
per listener. The cluster itself is the session fixture ``secured``
(tests/faults/conftest.py): one JVM for every module that needs it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from devkit.apache_kafka import KafkaCluster
from devkit.kafka_pki import Pki
from devkit.kafka_security import Acl, client_settings, unsecured_token, worker_acls
from worker.ops.broker import create_topics
from worker.ops.processes import WorkerProcess, spawn_worker

from .conftest import FAST_GROUP

PASSWORD = "s3cret-w0rker-pass"  # grepped for in logs: it must never appear
CLIENT_PASSWORD = "s3cret-cl1ent-pass"
WORKER = "User:worker"


def acls_for(names: dict[str, str], transactional_id: str | None = None) -> list[Acl]:
    return worker_acls(
        WORKER,
        inputs=[names["requests"]],
        output=names["results"],
        dlq=names["dlq"],
        group=names["group"],
        crash_guard=names["guard"],
        transactional_id=transactional_id,
    )


async def topics(cluster: KafkaCluster, names: dict[str, str], partitions: int = 2) -> None:
    await create_topics(
        cluster.bootstrap,
        {names["requests"]: partitions, names["results"]: partitions, names["dlq"]: 1,
         names["guard"]: 1},
    )  # fmt: skip


def secrets_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="secrets-"))
    d.chmod(0o700)
    return d


def worker_security(
    cluster: KafkaCluster, pki: Pki, listener: str, mechanism: str = "SCRAM-SHA-512"
) -> dict[str, str]:
    """A worker's settings for ``listener``, secrets from files as an operator
    mounts them (a password file, a token file)."""
    secrets = secrets_dir()
    if listener == "OAUTH":
        token = secrets / "token"
        token.write_text(unsecured_token("worker") + "\n")
        env = client_settings("OAUTH", cluster.listener("OAUTH"), pki, mechanism="OAUTHBEARER")
        return {**env, "INFER_WORKER_KAFKA__SASL_OAUTH_TOKEN_FILE": str(token)}
    env = client_settings(listener, cluster.listener(listener), pki, user="worker",
                          password=PASSWORD, mechanism=mechanism)  # fmt: skip
    if listener == "SASL_SSL":
        password = secrets / "password"
        password.write_text(PASSWORD + "\n")
        del env["INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD"]
        env["INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD_FILE"] = str(password)
    return env


def spawn(
    cluster: KafkaCluster, names: dict[str, str], security: dict[str, str], **env: str
) -> WorkerProcess:
    bootstrap = security["INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS"]
    return spawn_worker(
        bootstrap,
        input_topics=[names["requests"]],
        output_topic=names["results"],
        dlq_topic=names["dlq"],
        group_id=names["group"],
        extra_env={**FAST_GROUP, **security, "INFER_WORKER_KAFKA__CRASH_GUARD_TOPIC":
                   names["guard"], **env},
    )  # fmt: skip


def assert_no_secret(text: str) -> None:
    assert PASSWORD not in text and CLIENT_PASSWORD not in text
    assert unsecured_token("worker").split(".")[0] + "." not in text  # no token either


def run_until_exit(env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    return subprocess.run(
        [sys.executable, "-m", "worker", "run"],
        env={**base, **FAST_GROUP, "INFER_WORKER_METRICS__PORT": "0", **env},
        capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def client_env(cluster: KafkaCluster, pki: Pki, names: dict[str, str]) -> dict[str, str]:
    """The environment a client's tools run with: principal ``client`` over
    SASL_SSL, the test's topics, nothing of this process's ``INFER_WORKER_*``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    env |= client_settings("SASL_SSL", cluster.listener("SASL_SSL"), pki, user="client",
                           password=CLIENT_PASSWORD)  # fmt: skip
    return env | {
        "INFER_WORKER_KAFKA__INPUT_TOPICS": names["requests"],
        "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
        "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"],
    }
