"""The worker on a secured Apache Kafka (issue 29): TLS with SASL (SCRAM-SHA-512,
PLAIN), mutual TLS, and OAUTHBEARER, with ACLs enforced
(``allow.everyone.if.no.acl.found=false``) and the worker given exactly the ACLs
docs/guides/secure.md lists. Certificates are made for the run
(``devkit/kafka_pki.py``), the cluster is ``devkit/kafka_security.py``'s.

The harness (topic creation, producing requests, reading answers, granting and
revoking ACLs) uses the node's own PLAINTEXT listener as a super user; the
worker and the client library only ever get a secured listener."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devkit.apache_kafka import KafkaCluster
from devkit.kafka_pki import Pki
from devkit.kafka_security import (
    Acl,
    grant,
    revoke,
)
from worker.config import KafkaConfig
from worker.kafka.credentials import security_kwargs
from worker.ops.processes import WorkerProcess
from worker.ops.topics import Collector, committed_offsets, produce_all
from worker.ops.verify import check, read_topics

from .conftest import no_crash_in_log, request, wait_assigned, wait_ready
from .secured import (
    CLIENT_PASSWORD,
    PASSWORD,
    WORKER,
    acls_for,
    assert_no_secret,
    client_env,
    run_until_exit,
    spawn,
    topics,
    worker_security,
)

pytestmark = pytest.mark.faults


@pytest.mark.parametrize(
    ("listener", "mechanism"),
    [("SASL_SSL", "SCRAM-SHA-512"), ("SASL_SSL", "PLAIN"), ("SSL", ""), ("OAUTH", "")],
)
async def test_a_worker_with_only_its_acls_answers_every_request(
    secured: KafkaCluster, pki: Pki, names: dict[str, str], listener: str, mechanism: str
) -> None:
    """Each listener and mechanism, the worker holding exactly README's ACLs (at
    least once); the client library sends the requests over SASL_SSL as a user
    of its own, with ACLs for a client."""
    await topics(secured, names)
    await grant(secured.bootstrap, acls_for(names))
    client = "User:client"
    await grant(secured.bootstrap, [
        Acl(client, "Write", "topic", names["requests"]),
        Acl(client, "Read", "topic", names["results"]),
    ])  # fmt: skip
    w = spawn(secured, names, worker_security(secured, pki, listener, mechanism or "PLAIN"))
    try:
        await wait_assigned([w], 2)
        from worker.client import InferenceClient

        client_kafka = KafkaConfig(
            bootstrap_servers=secured.listener("SASL_SSL"),
            security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_plain_username="client",
            sasl_plain_password=CLIENT_PASSWORD,
            ssl_cafile=str(pki.ca),
        )
        async with InferenceClient(
            client_kafka.bootstrap_servers,
            input_topic=names["requests"],
            output_topic=names["results"],
            security=security_kwargs(client_kafka),
        ) as c:
            import numpy as np

            images = [np.full((8, 8, 1), i * 10, dtype=np.uint8) for i in range(20)]
            results = await asyncio.gather(*(c.infer(img, timeout=60) for img in images))
        assert [r.status for r in results] == ["ok"] * 20, [r.error for r in results]
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
        assert_no_secret(w.log_tail(10**6))
    finally:
        w.kill()


@pytest.mark.parametrize("listener", ["SASL_SSL", "SSL"])
async def test_exactly_once_across_a_sigkill_with_only_its_acls(
    secured: KafkaCluster, pki: Pki, names: dict[str, str], listener: str
) -> None:
    """SASL_SSL (SCRAM, password from a file) and mutual TLS, exactly-once, the
    member SIGKILLed mid-stream and restarted: a read_committed reader sees every
    request answered once, and the worker never held more than README's ACLs
    (its transactional id included)."""
    n, member = 1500, "w1"
    await topics(secured, names)
    await grant(secured.bootstrap, acls_for(names, transactional_id=f"{names['group']}.{member}"))
    security = worker_security(secured, pki, listener)
    eos = {
        "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
        "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": member,
        "INFER_WORKER_KAFKA__MAX_POLL_RECORDS": "100",
    }
    w = spawn(secured, names, security, **eos)
    restarted: WorkerProcess | None = None
    try:
        await wait_assigned([w], 2)
        producing = asyncio.create_task(
            produce_all(secured.bootstrap, names["requests"],
                        [(None, request(i)) for i in range(n)], rate=600)
        )  # fmt: skip
        await asyncio.sleep(1.0)
        w.kill()
        restarted = spawn(secured, names, security, **eos)
        await producing
        committed = Collector(
            secured.bootstrap, [names["results"]], isolation_level="read_committed"
        )
        await committed.start()
        try:
            done = await committed.collect(lambda c: c.count() >= n, 120.0)
            assert done, f"{committed.count()} of {n}\n{restarted.log_tail()}"
        finally:
            await committed.stop()
        assert restarted.terminate() == 0, restarted.log_tail()
        no_crash_in_log(restarted)
    finally:
        w.kill()
        if restarted is not None:
            restarted.kill()
    inputs, seen = await read_topics(
        secured.bootstrap, [names["requests"]], names["results"], names["dlq"],
        idle_timeout=1.5, isolation_level="read_committed",
    )  # fmt: skip
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable, strict=True)
    assert report.totals.requests == n and report.ok, report.format()
    for proc in (w, restarted):
        assert_no_secret(proc.log_tail(10**6))


REFUSALS = {
    "wrong-password": ("SASL_SSL", {"INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD": "not-it"},
                       None, "kafka.sasl_plain_username / sasl_plain_password"),
    "unknown-CA": ("SASL_SSL", {"INFER_WORKER_KAFKA__SSL_CAFILE": "{stranger_ca}"},
                   None, "kafka.ssl_cafile: the broker's certificate"),
    "expired-certificate": ("SSL", {"INFER_WORKER_KAFKA__SSL_CERTFILE": "{expired.cert}",
                                    "INFER_WORKER_KAFKA__SSL_KEYFILE": "{expired.key}"},
                            None, "kafka.ssl_certfile: {expired.cert} expired on"),
    "certificate-of-another-CA": ("SSL", {"INFER_WORKER_KAFKA__SSL_CERTFILE": "{stranger.cert}",
                                          "INFER_WORKER_KAFKA__SSL_KEYFILE": "{stranger.key}"},
                                  None, "kafka.ssl_certfile: the broker at"),
    "no-Read-on-the-group": ("SASL_SSL", {}, Acl(WORKER, "Read", "group", "{group}"),
                             "not allowed Read on group {group}"),
    "no-Read-on-an-input-topic": ("SASL_SSL", {}, Acl(WORKER, "Read", "topic", "{requests}"),
                                  "not allowed Read on topic {requests}"),
    "no-Write-on-the-result-topic": ("SASL_SSL", {}, Acl(WORKER, "Write", "topic", "{results}"),
                                     "not allowed Write on topic {results}"),
    "no-Write-on-the-DLQ": ("SASL_SSL", {}, Acl(WORKER, "Write", "topic", "{dlq}"),
                            "not allowed Write on topic {dlq}"),
    "no-Write-on-the-crash-guard-topic": ("SASL_SSL", {}, Acl(WORKER, "Write", "topic", "{guard}"),
                                          "not allowed Write on topic {guard}"),
    "no-Write-on-the-transactional-id": (
        "SASL_SSL", {"INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
                     "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "m1"},
        Acl(WORKER, "Write", "transactional_id", "{group}.m1"),
        "not allowed Write on its transactional id"),
    # Protocol mismatches (issue 37): named as such, not "cannot reach Kafka".
    "SASL_PLAINTEXT-on-a-TLS-listener": (
        "SASL_SSL", {"INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT"}, None,
        "speaks TLS: set security_protocol = SASL_SSL"),
    "SSL-on-a-plaintext-listener": (
        "SSL", {"INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "{plaintext}"}, None,
        "does not speak TLS (it answered plaintext Kafka): set security_protocol = PLAINTEXT"),
    "SSL-on-a-SASL-listener": (
        "SASL_SSL", {"INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "SSL"}, None,
        "asks for SASL authentication: set security_protocol = SASL_SSL"),
    "SASL_SSL-on-a-mutual-TLS-listener": (
        "SSL", {"INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                "INFER_WORKER_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
                "INFER_WORKER_KAFKA__SASL_PLAIN_USERNAME": "worker",
                "INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD": PASSWORD}, None,
        "takes no SASL (it refused the SASL handshake): set security_protocol = SSL"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_a_refused_credential_or_missing_acl_exits_2_naming_it(
    secured: KafkaCluster, pki: Pki, names: dict[str, str], case: str
) -> None:
    listener, overrides, withheld, expected = REFUSALS[case]
    fill = {"stranger_ca": pki.stranger_ca, "expired": pki.expired, "stranger": pki.stranger,
            "plaintext": secured.bootstrap, **names}  # fmt: skip
    await topics(secured, names)
    acls = acls_for(names, transactional_id=f"{names['group']}.m1")
    if withheld is not None:
        gone = Acl(withheld.principal, withheld.operation, withheld.kind,
                   withheld.name.format(**fill))  # fmt: skip
        acls = [a for a in acls if a != gone]
    await grant(secured.bootstrap, acls)
    env = {
        **worker_security(secured, pki, listener),
        "INFER_WORKER_KAFKA__INPUT_TOPICS": names["requests"],
        "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
        "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"],
        "INFER_WORKER_KAFKA__GROUP_ID": names["group"],
        "INFER_WORKER_KAFKA__CRASH_GUARD_TOPIC": names["guard"],
    }
    if "INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD" in overrides:
        env.pop("INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD_FILE", None)
    env |= {k: v.format(**fill) for k, v in overrides.items()}
    proc = await asyncio.to_thread(run_until_exit, env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected.format(**fill) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert_no_secret(proc.stdout + proc.stderr)


async def test_a_write_acl_revoked_while_serving_holds_offsets_until_it_is_back(
    secured: KafkaCluster, pki: Pki, names: dict[str, str]
) -> None:
    """Write on the result topic revoked while the worker runs: it goes not-ready,
    answers nothing and commits nothing (no fallback on the DLQ either); once the
    ACL is granted again every request is answered and committed."""
    await topics(secured, names)
    await grant(secured.bootstrap, acls_for(names))
    w = spawn(secured, names, worker_security(secured, pki, "SASL_SSL"))
    write = Acl(WORKER, "Write", "topic", names["results"])
    try:
        await wait_assigned([w], 2)
        await wait_ready(w, 200, 30)
        first = [(None, request(i)) for i in range(10)]
        await produce_all(secured.bootstrap, names["requests"], first, partition_of=lambda i: i % 2)
        results = Collector(secured.bootstrap, [names["results"], names["dlq"]])
        await results.start()
        try:
            assert await results.collect(lambda c: c.count() >= 10, 60.0), w.log_tail()
            await revoke(secured.bootstrap, [write])
            await produce_all(secured.bootstrap, names["requests"],
                              [(None, request(i)) for i in range(10, 30)],
                              partition_of=lambda i: i % 2)  # fmt: skip
            await wait_ready(w, 503, 60)
            held = await committed_offsets(secured.bootstrap, names["group"], names["requests"], 2)
            assert sum(held.values()) <= 10, held  # nothing past the first ten committed
            assert results.count() == 10 and not results.records.get(names["dlq"])
            await grant(secured.bootstrap, [write])
            assert await results.collect(lambda c: c.count() >= 30, 90.0), w.log_tail()
            statuses = [r.result().status for r in results.records[names["results"]]]
            assert statuses == ["ok"] * 30, "no answer became an error"
            await wait_ready(w, 200, 60)
        finally:
            await results.stop()
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
    inputs, seen = await read_topics(
        secured.bootstrap, [names["requests"]], names["results"], names["dlq"], idle_timeout=1.5
    )
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable)
    assert report.totals.requests == 30 and report.totals.lost == 0, report.format()
    log = w.log_tail(10**6)
    assert "not_authorised" in log and "TopicAuthorizationFailedError" in log
    assert_no_secret(log)


def test_config_command_masks_secrets(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    env |= {
        "INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        "INFER_WORKER_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "INFER_WORKER_KAFKA__SASL_PLAIN_USERNAME": "worker",
        "INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD": PASSWORD,
        "INFER_WORKER_KAFKA__SSL_PASSWORD": CLIENT_PASSWORD,
    }
    out = subprocess.run(
        [sys.executable, "-m", "worker", "config"], env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert "***" in out.stdout and "worker" in out.stdout
    assert_no_secret(out.stdout + out.stderr)


async def test_produce_consume_and_verify_speak_security(
    secured: KafkaCluster, pki: Pki, names: dict[str, str]
) -> None:
    """The operator's commands with a client's own principal over SASL_SSL:
    ``produce --samples`` waits for its answers, ``consume --id`` finds them,
    ``verify`` reads every topic; all from the same INFER_WORKER_KAFKA__* settings."""
    await topics(secured, names)
    await grant(secured.bootstrap, acls_for(names))
    client = "User:client"
    await grant(secured.bootstrap, [
        Acl(client, "Write", "topic", names["requests"]),
        *(Acl(client, "Read", "topic", names[t]) for t in ("requests", "results", "dlq")),
    ])  # fmt: skip
    w = spawn(secured, names, worker_security(secured, pki, "SASL_SSL"))
    env = client_env(secured, pki, names)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "worker", *args], env=env,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip

    try:
        await wait_assigned([w], 2)
        produced = await asyncio.to_thread(cli, "produce", "--samples", "3", "--json")
        assert produced.returncode == 0, produced.stderr[-2000:]
        ids = [line.split('"id": "')[1].split('"')[0] for line in produced.stdout.splitlines()]
        assert len(ids) == 3
        consumed = await asyncio.to_thread(cli, "consume", *(f"--id={i}" for i in ids),
                                           "--timeout", "30", "--json")  # fmt: skip
        assert consumed.returncode == 0, consumed.stderr[-2000:]
        verified = await asyncio.to_thread(cli, "verify", "--idle-timeout", "1.5")
        assert verified.returncode == 0 and "3 requests, all answered" in verified.stdout, (
            verified.stdout + verified.stderr[-2000:]
        )
        for run in (produced, consumed, verified):
            assert_no_secret(run.stdout + run.stderr)
    finally:
        w.kill()


async def test_a_read_acl_revoked_while_serving_makes_the_worker_not_ready_until_back(
    secured: KafkaCluster, pki: Pki, names: dict[str, str]
) -> None:
    await topics(secured, names)
    await grant(secured.bootstrap, acls_for(names))
    w = spawn(secured, names, worker_security(secured, pki, "SASL_SSL"))
    read = Acl(WORKER, "Read", "topic", names["requests"])
    try:
        await wait_assigned([w], 2)
        await wait_ready(w, 200, 30)
        await revoke(secured.bootstrap, [read])
        await wait_ready(w, 503, 60)
        await grant(secured.bootstrap, [read])
        records = [(None, request(i)) for i in range(10)]
        await produce_all(secured.bootstrap, names["requests"], records)
        results = Collector(secured.bootstrap, [names["results"]])
        await results.start()
        try:
            assert await results.collect(lambda c: c.count() >= 10, 60.0), w.log_tail()
        finally:
            await results.stop()
        await wait_ready(w, 200, 30)
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()


async def test_topics_create_and_check_reach_a_secured_cluster(
    secured: KafkaCluster, pki: Pki, names: dict[str, str]
) -> None:
    """``infer-worker topics`` connects as the worker does (SASL_SSL, a client
    principal allowed to create and describe its own topics, nothing else):
    check finds them missing, create makes them, check then passes (issue 56)."""
    client = "User:client"
    prefix = names["requests"].rsplit(".", 1)[0] + "."
    await grant(secured.bootstrap, [
        Acl(client, "Create", "topic", prefix + "*"),
        Acl(client, "Describe", "topic", prefix + "*"),
        Acl(client, "DescribeConfigs", "topic", prefix + "*"),
    ])  # fmt: skip
    env = client_env(secured, pki, names) | {
        "INFER_WORKER_KAFKA__CRASH_GUARD_TOPIC": names["guard"],
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "worker", "topics", *args], env=env,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip

    before = await asyncio.to_thread(cli, "check")
    assert before.returncode == 1 and before.stdout.count("MISSING") == 4, before.stdout
    made = await asyncio.to_thread(cli, "create", "--partitions", "2")
    assert made.returncode == 0, made.stdout + made.stderr[-2000:]
    assert "replication 1" in made.stdout  # the smaller of 3 and the brokers
    after = await asyncio.to_thread(cli, "check")
    assert after.returncode == 0, after.stdout + after.stderr[-2000:]
    assert "compact" not in after.stdout  # the crash-guard topic is compacted as needed
    for run in (before, made, after):
        assert_no_secret(run.stdout + run.stderr)
