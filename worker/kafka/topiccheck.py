"""Whether the topics a configuration names exist, asked once and answered in
the settings' words: the worker at start-up and every tool (produce, topics
check) use it, so a misspelt topic is never mistaken for an unreachable broker
(aiokafka waits on a missing topic's metadata until its request timeout and then
raises what a broker outage raises)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import structlog
from aiokafka.errors import UnknownTopicOrPartitionError

from worker.config import KafkaConfig, Settings
from worker.config.topics import needed_topics
from worker.flow.errors import ConfigError

log = structlog.get_logger(__name__)

# Shown in the error: enough to spot a typo, not a cluster's whole listing.
_SHOWN = 20


async def existing_topics(client: Any) -> set[str]:
    """The topics the cluster has, from one metadata request for all topics
    (which, unlike a request naming a topic, never auto-creates one).
    ``client``: an aiokafka producer's or consumer's ``client``."""
    cluster = await client.fetch_all_metadata()
    return set(cluster.topics())


def missing(wanted: Iterable[str], existing: set[str]) -> list[str]:
    """``wanted`` that ``existing`` lacks, in order, once each."""
    return [t for t in dict.fromkeys(wanted) if t and t not in existing]


def require_needed(s: Settings, existing: set[str]) -> None:
    """Every topic the worker reads or writes must exist, or it stops at once
    with exit 2 naming the setting: a misspelt input topic would be waited on
    silently (or created empty by a broker that creates topics on demand), a
    misspelt output or DLQ topic would let the worker read, report ready, and
    fail every delivery. The topics are the one list ``topics create`` makes
    (``worker.config.topics``); the default crash-guard topic is optional
    (without it crash-loop protection is off, said at start)."""
    by_setting: dict[str, list[str]] = {}
    for topic in needed_topics(s):
        if topic.required:
            by_setting.setdefault(topic.setting, []).append(topic.name)
    for setting, names in by_setting.items():
        require_topics(setting, names, existing, s.kafka)


def require_topics(setting: str, wanted: Sequence[str], existing: set[str], k: KafkaConfig) -> None:
    """Raise ``ConfigError`` (exit 2) naming ``setting`` and the topics of ``wanted``
    the cluster lacks, with the topics it has and how to create them."""
    absent = missing(wanted, existing)
    if not absent:
        return
    shown = sorted(existing)[:_SHOWN]
    more = f" and {len(existing) - _SHOWN} more" if len(existing) > _SHOWN else ""
    unseen = (
        ""
        if k.security_protocol == "PLAINTEXT"
        else ", or this principal may not Describe them (docs/guides/secure.md)"
    )
    raise ConfigError(
        f"{setting}: {', '.join(absent)} not found on {k.bootstrap_servers} (create "
        f"{'it' if len(absent) == 1 else 'them'} first: infer-worker topics create "
        f"--config FILE; existing topics: {', '.join(shown) or 'none'}{more}{unseen})"
    )


class MissingTopics:
    """Delivery to a topic the broker says does not exist (deleted while the worker
    runs): logged once per topic, naming the setting that names it, instead of a
    line per refused record that names neither. Logged again only after a
    delivery to it succeeded (``delivered``)."""

    def __init__(self, k: KafkaConfig) -> None:
        self._settings = {
            k.output_topic: "kafka.output_topic",
            k.dlq_topic: "kafka.dlq_topic",
            k.crash_guard_topic: "kafka.crash_guard_topic",
        }
        if k.state_topic:
            self._settings[k.state_topic] = "kafka.state_topic"
        self._logged: set[str] = set()

    def refused(self, topic: str, failure: BaseException | None) -> bool:
        """True when ``failure`` says ``topic`` does not exist (logged the first
        time); False for any other failure, which the caller reports itself."""
        if not isinstance(failure, UnknownTopicOrPartitionError):
            return False
        if topic not in self._logged:
            self._logged.add(topic)
            log.error(
                "topic_missing", topic=topic, setting=self._settings.get(topic, "?"),
                effect="its records are held unacknowledged (their offsets uncommitted) and "
                "sent again until the topic exists; the worker reports not ready",
                fix="create the topic (infer-worker topics create --config FILE)",
            )  # fmt: skip
        return True

    def delivered(self) -> None:
        self._logged.clear()


async def partition_counts(k: KafkaConfig, topics: Iterable[str]) -> dict[str, int]:
    """Each of ``topics``' partition count (0 where it does not exist), asked with
    ``k``'s connection (security included)."""
    from aiokafka import AIOKafkaConsumer

    from worker.kafka.clients import started, topic_partitions
    from worker.kafka.credentials import connection

    consumer = await started(AIOKafkaConsumer(**connection(k), enable_auto_commit=False))
    try:
        return {t: len(await topic_partitions(consumer, t)) for t in topics}
    finally:
        await consumer.stop()


def idle_members(groups: Sequence[tuple[Sequence[str], int]], counts: dict[str, int]) -> str | None:
    """Why some of a group's members would hold no partition, or None. ``groups``:
    (the topics some members read, how many members read them), as ``run --procs
    N`` starts them; a member without a partition idles (a hot standby, at best),
    which on one GPU is a process holding memory for nothing."""
    for topics, members in groups:
        have = sum(counts.get(t, 0) for t in topics)
        if 0 < have < members:
            named = ", ".join(f"{t} ({counts.get(t, 0)})" for t in topics)
            return (
                f"--procs: {members} members read {named}: {have} partition"
                f"{'s' * (have != 1)} in all, so {members - have} would hold none and idle; "
                f"give the topics at least {members} partitions (kafka-topics.sh --alter "
                "--partitions adds them) or start fewer members"
            )
    return None
