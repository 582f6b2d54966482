"""The models' control topic (``kafka.control_topic``, compacted): each record a
repository model's desired state, keyed by its name, read by every member alike
from the beginning (no consumer group: no member skips a record another saw),
then followed; and written by ``infer-worker models load``.

A value is JSON, so an operator can write one with any Kafka tool
(``{"version": 3}``); an empty value (a tombstone) deletes the key once the
topic is compacted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition as KafkaTP

from worker.config.kafka import KafkaConfig
from worker.flow.errors import BrokerUnavailable
from worker.kafka.clients import topic_partitions
from worker.kafka.credentials import connection

log = structlog.get_logger(__name__)

Apply = Callable[[str, bytes | None], Awaitable[bool]]  # whether it took effect


async def follow(k: KafkaConfig, apply: Apply, ready: asyncio.Event | None = None) -> None:
    """Until cancelled: the control topic read from the beginning to the end
    found at start, then ``ready`` set, then each new record applied as it
    comes (``apply(name, value)``: whether it took effect).

    What was there at start is applied as the members already serving applied
    it, one record at a time, but without loading every version in turn: for
    each key its last record, or where that one is refused, the one before it,
    and so on (a member applying them in order kept the last it did not refuse).
    A record refused by every member alike (a version not held, one failing its
    checks) is refused here too; the CLI writes only versions the repository
    holds."""
    consumer = AIOKafkaConsumer(**connection(k), enable_auto_commit=False, fetch_max_wait_ms=200)
    await consumer.start()
    try:
        history = await _history(consumer, k.control_topic)
        for model, values in history.items():
            for value in reversed(values):
                if await apply(model, value):
                    break
        if ready is not None:
            ready.set()
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            for records in batch.values():
                for r in records:
                    if (name := _name(r.key)) is not None:
                        await apply(name, r.value)
    finally:
        await consumer.stop()


async def read_states(k: KafkaConfig) -> dict[str, bytes | None]:
    """Each model's last record on the control topic (its desired state as the
    members will apply it, or a tombstone), read from the beginning to the end
    found at the start (``infer-worker models list``)."""
    consumer = AIOKafkaConsumer(**connection(k), enable_auto_commit=False, fetch_max_wait_ms=200)
    try:
        await consumer.start()
        history = await _history(consumer, k.control_topic)
    finally:
        await consumer.stop()  # (a start that failed too: its connections closed)
    return {name: values[-1] for name, values in history.items()}


async def _history(consumer: AIOKafkaConsumer, topic: str) -> dict[str, list[bytes | None]]:
    """Each key's records on ``topic``, in order, from its beginning to the end
    found at the start (the consumer assigned every partition of it)."""
    parts = await topic_partitions(consumer, topic)
    if not parts:
        raise BrokerUnavailable(f"kafka.control_topic: {topic!r} does not exist")
    tps = [KafkaTP(topic, p) for p in sorted(parts)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    history: dict[str, list[bytes | None]] = {}  # each key's records, in order
    pending = set(tps)  # not yet read to the end found at start
    while pending:
        batch = await consumer.getmany(*pending, timeout_ms=200)
        for records in batch.values():
            for r in records:
                if (name := _name(r.key)) is not None:
                    history.setdefault(name, []).append(r.value)
        for tp in list(pending):
            # The end as the last fetch answered it (end_offsets is not reliable
            # on every broker: the embedded one answers it wrongly).
            end = consumer.highwater(tp)
            if end is not None and await consumer.position(tp) >= end:
                pending.discard(tp)
    return history


def _name(key: bytes | None) -> str | None:
    """A record's model name, or None (logged) where it has none."""
    try:
        return key.decode() if key else None
    except UnicodeDecodeError:
        log.warning("model_control_record_skipped", reason="its key is not UTF-8")
        return None


async def write(k: KafkaConfig, name: str, state: dict[str, object] | None) -> None:
    """One model's desired state on the control topic (None: a tombstone),
    acknowledged by every in-sync replica."""
    producer = AIOKafkaProducer(**connection(k), acks="all")
    await producer.start()
    try:
        value = None if state is None else json.dumps(state, sort_keys=True).encode()
        await producer.send_and_wait(k.control_topic, value, key=name.encode())
    finally:
        await producer.stop()
