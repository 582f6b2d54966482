"""A stateful model's durable states, wired at start-up: the state changelog
(``kafka.state_topic``, ``worker.kafka.changelog``) checked against the input
topic, and each assignment's partitions restored into the inference stage's
sequence states before any of their records is processed."""

from __future__ import annotations

import time

import structlog

from worker.app.plan import RunPlan
from worker.app.stages import Stages
from worker.config import Settings
from worker.flow.errors import ConfigError
from worker.flow.messages import TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka import changelog
from worker.obs import metrics

log = structlog.get_logger(__name__)


async def wire_states(
    s: Settings, plan: RunPlan, stages: Stages, existing: set[str], tracker: OffsetTracker
) -> None:
    """Check the changelog and have the consumer restore from it, for a stateful
    model with ``kafka.state_topic``; say where states live otherwise."""
    # Durable states: one model (kafka.state_topic is refused beside others).
    sequences = stages.models[0].infer.sequences if len(stages.models) == 1 else None
    topic = s.kafka.state_topic
    if sequences is None:
        if topic:
            log.warning("state_topic_unused", topic=topic, reason="the model has no [model.state]")
        return
    if not topic:
        log.warning(
            "states_in_memory_only",
            effect="a sequence's state is lost when its partition moves or the worker stops",
            fix="set kafka.state_topic (docs/guides/stateful.md)",
        )
        return
    await _check_changelog(s, stages, existing)

    async def restore(tps: list[TopicPartition]) -> None:
        started = time.monotonic()
        states = await changelog.restore(
            s.kafka, sorted({tp.partition for tp in tps}), s.model.state_ttl_s, plan.exactly_once
        )
        now = time.monotonic()
        restored = sum(sequences.restore(tp, states[tp.partition], now) for tp in tps)
        seconds = time.monotonic() - started
        metrics.STATE_RESTORES.inc(len(tps))
        metrics.STATE_RESTORE_SECONDS.observe(seconds)
        metrics.RESTORED_SEQUENCES.inc(restored)
        metrics.LIVE_SEQUENCES.labels(s.model.name).set(len(sequences))
        log.info("states_restored", partitions=len(tps), sequences=restored, seconds=seconds)

    stages.consumer.restore_with(restore)


async def _check_changelog(s: Settings, stages: Stages, existing: set[str]) -> None:
    """One input topic, and a changelog with as many partitions: a sequence's
    state lives on the partition number of its requests."""
    k = s.kafka
    if len(k.input_topics) != 1:
        raise ConfigError(
            f"kafka.state_topic: durable states need one input topic (the changelog is "
            f"co-partitioned with it), got {len(k.input_topics)}"
        )
    if k.state_topic not in existing:
        raise ConfigError(
            f"kafka.state_topic: {k.state_topic} not found; create it compacted "
            f"(cleanup.policy=compact) with as many partitions as {k.input_topics[0]}"
        )
    producer = stages.writer.producer
    assert producer is not None
    inputs = len(await producer.partitions_for(k.input_topics[0]))
    states = len(await producer.partitions_for(k.state_topic))
    if inputs != states:
        raise ConfigError(
            f"kafka.state_topic: {k.state_topic} has {states} partitions, the input topic "
            f"{k.input_topics[0]} {inputs}; they must be equal (co-partitioned)"
        )
