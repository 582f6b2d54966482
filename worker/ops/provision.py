"""``infer-worker topics check | create``: the topics a configuration needs, listed,
checked against a cluster and created where missing (the worker itself never
creates a topic: it refuses to start without them, naming the setting).

What a configuration needs, and how each is made when ``create`` makes it:

- every input topic (``kafka.input_topics``, the lanes' among them) and the
  output topic: ``--partitions`` (6: room for six members of a group);
- the DLQ topic: 1 partition (rare records; a shadow writes none, so it needs none);
- the crash-guard topic, when crash-loop protection is on
  (``limits.max_crash_attempts`` > 0, not a shadow): 1 partition, compacted
  (one mark per group and partition, the latest wins);
- the state changelog (``kafka.state_topic``), when set: compacted, with as many
  partitions as the input topic (a sequence's state lives on its partition);
- a pipeline step's topic (``pipelines.NAME.steps[i].topic``), when set:
  ``--partitions``.

Replication is ``--replication-factor``, by default the smaller of 3 and the
cluster's brokers. Topics that exist are left as they are and reported (a wrong
partition count of a changelog, a crash-guard topic that is not compacted, are
named by ``check``). Works on any cluster the configuration's Kafka settings
reach, secured ones included: the same connection the worker makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
)

from worker.config import Settings
from worker.config.topics import DEFAULT_PARTITIONS, NeededTopic, needed_topics
from worker.flow.deadline import Deadline
from worker.kafka.credentials import connection
from worker.kafka.diagnose import run_tool

log = structlog.get_logger(__name__)

def needed(s: Settings, partitions: int = DEFAULT_PARTITIONS) -> list[NeededTopic]:
    """The topics the worker configured by ``s`` reads or writes, in that order:
    the one list (``worker.config.topics``) the worker's start-up check reads too."""
    return needed_topics(s, partitions)


@dataclass(frozen=True)
class Found:
    """One needed topic as the cluster has it (``partitions`` 0: missing)."""

    topic: NeededTopic
    partitions: int
    configs: dict[str, str] | None  # None: this principal may not read them

    @property
    def exists(self) -> bool:
        return self.partitions > 0

    def problems(self, partner_partitions: int) -> list[str]:
        """What is wrong with the topic as it exists (empty when missing or fine);
        ``partner_partitions``: those of the input topic it is co-partitioned with
        (0: none, or missing)."""
        if not self.exists:
            return []
        out = []
        for key, value in self.topic.configs.items():
            if self.configs is not None and self.configs.get(key) != value:
                out.append(f"{key} is {self.configs.get(key) or 'unset'}, needs {value}")
        if partner_partitions and self.partitions != partner_partitions:
            partner = self.topic.co_partitioned or "the input topic"
            out.append(f"{self.partitions} partitions, {partner} {partner_partitions} "
                       "(they must be equal: co-partitioned)")  # fmt: skip
        return out


async def survey(s: Settings, topics: Sequence[NeededTopic]) -> tuple[list[Found], int]:
    """Each needed topic as the cluster has it, and how many brokers it has."""
    admin = AIOKafkaAdminClient(**connection(s.kafka))
    await admin.start()
    try:
        # One metadata request for every topic (it creates none): the topics this
        # principal may Describe, their partitions, and the brokers.
        cluster = await admin._client.fetch_all_metadata()
        counts = {t: len(cluster.partitions_for_topic(t) or ()) for t in cluster.topics()}
        present = [t.name for t in topics if counts.get(t.name)]
        try:
            configs = await _configs(admin, present)
        except (TopicAuthorizationFailedError, ClusterAuthorizationFailedError):
            configs = {}  # not allowed DescribeConfigs: compaction cannot be checked
            log.warning("topic_configs_unreadable", topics=present,
                        fix="grant DescribeConfigs on them to check cleanup.policy")  # fmt: skip
        found = [Found(t, counts.get(t.name, 0), configs.get(t.name)) for t in topics]
        return found, len(cluster.brokers())
    finally:
        await admin.close()


async def _configs(admin: AIOKafkaAdminClient, names: Sequence[str]) -> dict[str, dict[str, str]]:
    if not names:
        return {}
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    responses = await admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
    )
    out: dict[str, dict[str, str]] = {}
    for response in responses:
        for code, _message, _type, name, entries in response.resources:
            if code == 0:  # else (not allowed, say): unknown, not "unset"
                out[name] = {entry[0]: entry[1] for entry in entries}
    return out


def input_partitions(found: Sequence[Found]) -> int:
    """The first input topic's partitions (0 when it is missing)."""
    return next((f.partitions for f in found if f.topic.setting == "kafka.input_topics"), 0)


def partner_partitions(found: Sequence[Found], f: Found) -> int:
    """The partitions of the input topic ``f`` is co-partitioned with (0: none)."""
    if not f.topic.co_partitioned:
        return 0
    return next((g.partitions for g in found if g.topic.name == f.topic.co_partitioned), 0)


def report(found: Sequence[Found]) -> list[str]:
    """One line per needed topic: where the configuration names it and its state."""
    lines = []
    for f in found:
        state = f"{f.partitions} partition{'s' * (f.partitions != 1)}" if f.exists else "MISSING"
        problems = f.problems(partner_partitions(found, f))
        if problems:
            state += " (" + "; ".join(problems) + ")"
        lines.append(f"{f.topic.name:<32} {f.topic.setting:<24} {state}")
    return lines


def check(s: Settings) -> int:
    """``topics check``: exit 0 when every needed topic exists as needed, 1 not."""

    async def go() -> int:
        found, _ = await survey(s, needed(s))
        print("\n".join(report(found)))
        bad = [f for f in found if not f.exists or f.problems(partner_partitions(found, f))]
        if bad:
            print(f"{len(bad)} of {len(found)} topics missing or not as needed "
                  "(infer-worker topics create --config FILE creates the missing)",
                  file=sys.stderr)  # fmt: skip
        return 1 if bad else 0

    return run_tool(s.kafka, go())


def create(s: Settings, partitions: int, replication: int | None) -> int:
    """``topics create``: the missing ones created; exit 0 when all then exist."""

    async def go() -> int:
        topics = needed(s, partitions)
        found, brokers = await survey(s, topics)
        factor = replication or max(1, min(3, brokers))
        inputs = input_partitions(found) or partitions
        new = [
            NewTopic(f.topic.name,
                     num_partitions=f.topic.partitions or partner_partitions(found, f) or inputs,
                     replication_factor=factor, topic_configs=dict(f.topic.configs))
            for f in found if not f.exists
        ]  # fmt: skip
        await _create(s, new)
        for topic in new:
            n = topic.num_partitions
            print(f"created {topic.name}: {n} partition{'s' * (n != 1)}, replication {factor}")
        # Metadata is eventually consistent: a topic just created may be listed
        # without partitions for a moment.
        wait = Deadline(10.0)
        while True:
            found, _ = await survey(s, topics)
            if all(f.exists for f in found) or wait.expired:
                break
            await asyncio.sleep(0.1)
        print("\n".join(report(found)))
        return 0 if all(f.exists for f in found) else 1

    return run_tool(s.kafka, go())


async def _create(s: Settings, topics: Sequence[Any]) -> None:
    if not topics:
        return
    admin = AIOKafkaAdminClient(**connection(s.kafka))
    await admin.start()
    try:
        for topic in topics:  # one by one: one that exists meanwhile does not stop the rest
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([topic])
    finally:
        await admin.close()
