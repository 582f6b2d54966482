"""Stateful models' durable states, wired at start-up: each model's state
changelog (``kafka.state_topic`` for one model, ``models.NAME.state_topic``
beside others; ``worker.kafka.changelog``) checked against its input topic, and
each assignment's partitions restored into that model's sequence states before
any of their records is processed."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import structlog

from worker.app.plan import RunPlan
from worker.app.stages import ModelStages, Stages
from worker.config import Settings
from worker.config.models import served
from worker.flow.errors import ConfigError
from worker.flow.messages import TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka import changelog
from worker.obs import metrics

log = structlog.get_logger(__name__)


async def wire_states(
    s: Settings, plan: RunPlan, stages: Stages, existing: set[str], tracker: OffsetTracker
) -> None:
    """Check each stateful model's changelog and have the consumer restore from
    them on assignment; say where states live otherwise."""
    restores: dict[str, Restore] = {}  # by input topic
    for m in stages.models:
        restore = await _wired(s, plan, m, stages, existing)
        if restore is not None:
            restores.update(dict.fromkeys(m.topics, restore))
    if not restores:
        return

    async def restore_all(tps: list[TopicPartition]) -> None:
        by_restore: dict[int, tuple[Restore, list[TopicPartition]]] = {}
        for tp in tps:
            if (restore := restores.get(tp.topic)) is not None:
                by_restore.setdefault(id(restore), (restore, []))[1].append(tp)
        for restore, mine in by_restore.values():
            await restore(mine)

    stages.consumer.restore_with(restore_all)


Restore = Callable[[list[TopicPartition]], Awaitable[None]]


async def _wired(
    s: Settings, plan: RunPlan, m: ModelStages, stages: Stages, existing: set[str]
) -> Restore | None:
    """One model's restore from its changelog (``m.settings.kafka.state_topic``),
    checked; None where its states live in memory (said once)."""
    sequences = m.infer.sequences
    topic = m.settings.kafka.state_topic
    at = _setting(s, m.name)
    if sequences is None:
        if topic:
            log.warning("state_topic_unused", topic=topic, model=m.name,
                        reason="the model has no [model.state]")  # fmt: skip
        return None
    if not topic:
        log.warning(
            "states_in_memory_only", model=m.name,
            effect="a sequence's state is lost when its partition moves or the worker stops",
            fix=f"set {at} (docs/guides/stateful.md)",
        )  # fmt: skip
        return None
    await _check_changelog(at, topic, m.topics, stages, existing)
    k, ttl = m.settings.kafka, m.settings.model.state_ttl_s

    async def restore(tps: list[TopicPartition]) -> None:
        started = time.monotonic()
        states = await changelog.restore(
            k, sorted({tp.partition for tp in tps}), ttl, plan.exactly_once
        )
        now = time.monotonic()
        restored = sum(sequences.restore(tp, states[tp.partition], now) for tp in tps)
        seconds = time.monotonic() - started
        metrics.STATE_RESTORES.inc(len(tps))
        metrics.STATE_RESTORE_SECONDS.observe(seconds)
        metrics.RESTORED_SEQUENCES.inc(restored)
        metrics.LIVE_SEQUENCES.labels(m.name).set(len(sequences))
        log.info("states_restored", model=m.name, partitions=len(tps), sequences=restored,
                 seconds=seconds)  # fmt: skip

    return restore


def _setting(s: Settings, name: str) -> str:
    """Where a model's changelog is configured, as the user wrote it."""
    if s.kafka.state_topic or not (s.models or s.pipelines):
        return "kafka.state_topic"
    keys = {m.name: m.key for m in served(s)}  # models.NAME, or repository.NAME
    return f"{keys.get(name, 'model')}.state_topic"


async def _check_changelog(
    at: str, topic: str, inputs: tuple[str, ...], stages: Stages, existing: set[str]
) -> None:
    """One input topic, and a changelog with as many partitions: a sequence's
    state lives on the partition number of its requests."""
    if len(inputs) != 1:
        raise ConfigError(
            f"{at}: durable states need one input topic (the changelog is co-partitioned "
            f"with it), got {len(inputs)}"
        )
    if topic not in existing:
        raise ConfigError(
            f"{at}: {topic} not found; create it compacted (cleanup.policy=compact) with as "
            f"many partitions as {inputs[0]}"
        )
    producer = stages.writer.producer
    assert producer is not None
    partitions = len(await producer.partitions_for(inputs[0]))
    states = len(await producer.partitions_for(topic))
    if partitions != states:
        raise ConfigError(
            f"{at}: {topic} has {states} partitions, the input topic {inputs[0]} "
            f"{partitions}; they must be equal (co-partitioned)"
        )
