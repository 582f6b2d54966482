"""One Apache Kafka node's settings for the tests' clusters (``devkit.apache_kafka``).

Test-only broker settings (``TEST_SETTINGS``; a production cluster keeps
Kafka's defaults, see README "Apache Kafka in the tests"):

- ``group.initial.rebalance.delay.ms=0``: Kafka waits 3 s after a new group's
  first join for more members; tests start one member at a time and would pay
  that on every group.
- ``group.min.session.timeout.ms=500``: Kafka refuses session timeouts under 6 s;
  the tests use 2-3 s so a killed member is evicted quickly.
- ``offsets.topic.num.partitions=4`` (and ``transaction.state.log.num.partitions=4``):
  Kafka's 50 partitions make the group coordinator's first start slow on two cores.
- the internal topics' replication factor equal to the cluster size, and their
  ``min.isr`` 1 for one node, 2 for three.
- ``num.partitions=1``, ``auto.create.topics.enable=false``: the worker and the
  tests create every topic explicitly; a test that relied on auto-creation fails.
- ``broker.heartbeat.interval.ms=500``, ``broker.session.timeout.ms=3000``
  (2 s and 9 s), ``controller.quorum.fetch.timeout.ms=1000``,
  ``controller.quorum.election.timeout.ms=500`` (2 s and 1 s): how soon a
  killed or paused node is fenced (and, if it was the active controller,
  replaced) and its partitions get new leaders; the cluster fault tests wait so long.
- a 512 MiB JVM heap and the serial collector: CI has 2 cores and runs up to
  three nodes beside the workers.

``message.max.bytes`` is 16 MiB, as in docker-compose.yml (results can carry
tensors; the worker's ``kafka.max_request_size`` default is 16 MiB).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from pathlib import Path

TEST_SETTINGS: Mapping[str, str] = {
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "500",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.num.partitions": "4",
    "num.partitions": "1",
    "auto.create.topics.enable": "false",
    "broker.heartbeat.interval.ms": "500",
    "broker.session.timeout.ms": "3000",
    "controller.quorum.fetch.timeout.ms": "1000",
    "controller.quorum.election.timeout.ms": "500",
}
JVM_OPTIONS = ("-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-Djava.awt.headless=true")

LOG4J2 = """\
# Warnings and the lines that say a node started or stopped.
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.out.ref = out
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = info
"""


def server_properties(
    node_id: int, port: int, controller_port: int, voters: str, size: int, data: Path
) -> dict[str, str]:
    """One node's ``server.properties`` in a cluster of ``size`` combined
    broker/controller nodes with the static quorum ``voters``."""
    replication = str(min(size, 3))
    min_isr = "1" if size == 1 else "2"
    return {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(data),
        "message.max.bytes": str(16 * 1024 * 1024),
        "offsets.topic.replication.factor": replication,
        "transaction.state.log.replication.factor": replication,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": replication,
        "share.coordinator.state.topic.min.isr": min_isr,
        **TEST_SETTINGS,
    }


def cluster_id() -> str:
    """A KRaft cluster id: a random UUID in URL-safe base64 without padding
    (Kafka's own ``Uuid.randomUuid`` never returns one starting with '-')."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text
