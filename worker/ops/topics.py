"""Kafka topics read and written as a client would: produce, collect, offsets.

Used by the demo, ``verify`` and the tests. ``Collector`` reads whole topics from
the beginning without a consumer group, re-reading offset gaps the embedded
broker can show a tailing reader (see ``OffsetGaps``).
"""

from __future__ import annotations

import asyncio
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from worker.contract import Result, decode_result
from worker.flow.deadline import Deadline
from worker.flow.errors import ConfigError, UndecodableRecord
from worker.kafka.clients import started, topic_partitions
from worker.kafka.credentials import Connection, connect_kwargs
from worker.kafka.registry_results import RegistryResults


@dataclass
class Produced:
    key: bytes | None
    value: bytes
    sent_at: float  # monotonic
    partition: int
    offset: int
    timestamp_ms: int = 0  # the record's Kafka timestamp (the producer's clock)


async def produce_all(
    bootstrap: Connection,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes]],
    *,
    partition_of: Any = None,
    rate: float = 0.0,
    seed: int = 0,
    headers: Sequence[tuple[str, bytes]] | None = None,
    on_ready: Callable[[], object] | None = None,
) -> list[Produced]:
    """Produce records (each with ``headers``) and wait for all acks; returns each
    record's partition/offset and the time it was handed over.

    With ``rate`` > 0 the records are sent open-loop as a Poisson process of that
    mean rate (exponential gaps, seeded), whatever the answers do: a sender that
    waits for answers would slow down exactly when the worker queues, and hide
    the queueing it is meant to measure. ``on_ready`` is called once the producer
    is connected, before the first record (the schedule begins when it returns)."""
    producer = AIOKafkaProducer(
        **connect_kwargs(bootstrap),
        acks="all",
        linger_ms=2,
        max_request_size=16 * 1024 * 1024,
        max_batch_size=1024 * 1024,
    )
    await started(producer)
    try:
        pending: list[tuple[bytes | None, bytes, float, asyncio.Future[Any]]] = []
        gaps = random.Random(seed)
        if on_ready is not None:
            on_ready()
        due = time.monotonic()
        for i, (key, value) in enumerate(records):
            if rate > 0:
                due += gaps.expovariate(rate)
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            part = partition_of(i) if partition_of is not None else None
            sent_at = time.monotonic()
            fut = await producer.send(
                topic, value=value, key=key, partition=part, headers=list(headers or [])
            )
            pending.append((key, value, sent_at, fut))
        out = []
        for key, value, sent_at, fut in pending:
            meta = await fut
            out.append(Produced(key, value, sent_at, meta.partition, meta.offset, meta.timestamp))
        return out
    finally:
        await producer.stop()


@dataclass
class Collected:
    record_key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    partition: int
    offset: int
    received_at: float  # monotonic
    timestamp_ms: int = 0  # the record's Kafka timestamp (its producer's clock)
    # What reads a result in a Schema Registry format (the collector's, if it has one).
    registry: RegistryResults | None = None

    def result(self) -> Result:
        """The result, read in its format (an Open Inference Protocol JSON answer
        carries ``content-type: application/json``; one in a Schema Registry
        format starts with its magic byte, 0: read with the registry)."""
        if self.value[:1] == b"\x00":
            if self.registry is None:
                raise UndecodableRecord("a result in a Schema Registry format: give the tool "
                                        "the registry (--schema-registry URL, or the "
                                        "configuration's schema_registry.url)")  # fmt: skip
            return self.registry.result(self.value)
        if self.headers.get("content-type", b"").startswith(b"application/json"):
            from worker.contract.oip_client import decode_oip_result

            return decode_oip_result(self.value)
        return decode_result(self.value)


Verdict = Literal["take", "skip", "reread"]


@dataclass
class OffsetGaps:
    """Re-reads offset gaps in topics that should have none (no I/O).

    The embedded broker, with several producers appending to one partition at
    once (workers writing results), can show a later batch to a tailing reader
    before an earlier one; the reader's position then moves past the earlier
    records and it never sees them: answers the worker did produce were reported
    lost. A gap is therefore read again until it fills, for ``patience`` seconds,
    then accepted (compaction and transaction markers leave real gaps on Kafka).
    """

    patience: float = 5.0
    _next: dict[Any, int] = field(default_factory=dict)
    _gap: dict[Any, tuple[int, float]] = field(default_factory=dict)  # expected, since

    def start(self, tp: Any, offset: int) -> None:
        self._next[tp] = offset

    def expected(self, tp: Any) -> int | None:
        return self._next.get(tp)

    def check(self, tp: Any, offset: int, now: float) -> Verdict:
        expected = self._next.get(tp)
        if expected is not None and offset < expected:
            return "skip"
        if expected is not None and offset > expected:
            since = self._gap.get(tp)
            if since is None or since[0] != expected:
                since = self._gap[tp] = (expected, now)
            if now - since[1] < self.patience:
                return "reread"
        self._gap.pop(tp, None)
        self._next[tp] = offset + 1
        return "take"


class TopicUnreadable(ConfigError):
    """A topic the reader finds no partitions of: it does not exist, or the
    principal may not Describe it. A configuration error (exit 2) for every tool;
    typed, so a handler cannot also catch aiokafka's errors (RuntimeErrors too)."""


@dataclass
class Collector:
    """Reads whole topics from the beginning without a consumer group."""

    bootstrap: Connection
    topics: Sequence[str]
    records: dict[str, list[Collected]] = field(default_factory=dict)
    # "read_committed": only records of committed transactions (exactly-once output).
    isolation_level: str = "read_uncommitted"
    # Reads results in a Schema Registry format (``Collected.result``); None: none is read.
    registry: RegistryResults | None = None
    _consumer: AIOKafkaConsumer | None = None
    _gaps: OffsetGaps = field(default_factory=OffsetGaps)

    async def start(self) -> None:
        if self.isolation_level == "read_committed":
            # Kafka only; a transaction's commit marker is an offset no reader
            # sees, so gaps are expected there, not re-read.
            self._gaps.patience = 0.0
        consumer = AIOKafkaConsumer(
            **connect_kwargs(self.bootstrap),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=64 * 1024 * 1024,
            fetch_max_wait_ms=5,
            isolation_level=self.isolation_level,
        )
        await started(consumer)
        try:
            tps = []
            for topic in self.topics:
                parts = await topic_partitions(consumer, topic)
                for _ in range(100):
                    if parts:
                        break
                    await asyncio.sleep(0.05)
                    parts = await topic_partitions(consumer, topic)
                if not parts:
                    raise TopicUnreadable(
                        f"cannot read topic {topic}: it has no partitions (it does not "
                        "exist, or this principal is not allowed to Describe it)"
                    )
                tps += [TopicPartition(topic, p) for p in sorted(parts)]
                self.records.setdefault(topic, [])
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            for tp in tps:
                self._gaps.start(tp, await consumer.position(tp))
        except BaseException:
            await consumer.stop()  # a half-started reader closes what it opened
            raise
        self._consumer = consumer

    @property
    def partitions(self) -> list[TopicPartition]:
        """Every partition being read (all that the metadata listed at start)."""
        return [] if self._consumer is None else sorted(self._consumer.assignment())

    def count(self, topic: str | None = None) -> int:
        if topic is not None:
            return len(self.records.get(topic, []))
        return sum(len(v) for v in self.records.values())

    async def collect(self, until: Any, timeout: float, progress: Any = None) -> bool:
        """Fetch until ``until(self)`` is true or the timeout passes."""
        assert self._consumer is not None, "start() first"
        budget = Deadline(timeout)
        while not until(self):
            if budget.expired:
                return False
            batch = await self._consumer.getmany(timeout_ms=int(min(budget.left(), 0.2) * 1000))
            now = time.monotonic()
            for tp, msgs in batch.items():
                bucket = self.records[tp.topic]
                for m in msgs:
                    verdict = self._gaps.check(tp, m.offset, now)
                    if verdict == "skip":
                        continue
                    if verdict == "reread":
                        # Not yet visible records before this one: read from there again.
                        self._consumer.seek(tp, self._gaps.expected(tp))
                        break
                    headers = {k: bytes(v) for k, v in (m.headers or ())}
                    bucket.append(Collected(m.key, m.value, headers, m.partition, m.offset,
                                            now, m.timestamp, self.registry))  # fmt: skip
            if progress is not None:
                progress(self)
        return True

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()


async def committed_offsets(
    bootstrap: Connection, group_id: str, topic: str, partitions: int
) -> dict[int, int]:
    """The group's committed offsets per partition (-1 where none)."""
    consumer = AIOKafkaConsumer(
        **connect_kwargs(bootstrap), group_id=group_id, enable_auto_commit=False
    )
    await started(consumer)
    try:
        out = {}
        for p in range(partitions):
            value = await consumer.committed(TopicPartition(topic, p))
            out[p] = -1 if value is None else int(value)
        return out
    finally:
        await consumer.stop()


async def _partitions(consumer: AIOKafkaConsumer, topics: Sequence[str]) -> list[TopicPartition]:
    """Every partition of ``topics``, from the metadata (none for a missing topic)."""
    tps = []
    for topic in topics:
        tps += [TopicPartition(topic, p) for p in sorted(await topic_partitions(consumer, topic))]
    return tps


async def end_offsets(bootstrap: Connection, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    """Every partition's end offset (the next offset to be written), as the
    broker reports it. Apache Kafka only: the embedded broker answers
    ``end_offsets`` wrongly (DESIGN.md), which is why the readers here stop on
    idleness rather than at these offsets."""
    consumer = AIOKafkaConsumer(**connect_kwargs(bootstrap), enable_auto_commit=False)
    await started(consumer)
    try:
        ends = await consumer.end_offsets(await _partitions(consumer, topics))
        return {(tp.topic, tp.partition): int(end) for tp, end in ends.items()}
    finally:
        await consumer.stop()


async def offsets_since(
    bootstrap: Connection, topics: Sequence[str], since_ms: int
) -> dict[tuple[str, int], int]:
    """The first offset of each partition of ``topics`` whose record was written
    at or after ``since_ms`` (Kafka's timestamp index: ``offsets_for_times``); a
    partition with none, its end (nothing of it is that recent)."""
    consumer = AIOKafkaConsumer(**connect_kwargs(bootstrap), enable_auto_commit=False)
    await started(consumer)
    try:
        tps = await _partitions(consumer, topics)
        if not tps:
            raise RuntimeError(f"no partition of {', '.join(topics)} to read offsets of")
        found = await consumer.offsets_for_times(dict.fromkeys(tps, since_ms))
        ends = await consumer.end_offsets(tps)
        return {
            (tp.topic, tp.partition): (at.offset if at is not None else int(ends[tp]))
            for tp, at in found.items()
        }
    finally:
        await consumer.stop()


class Draining(ABC):
    """Takes what a ``Collector`` holds as it arrives and drops it (memory stays
    flat however long the topics), and says when they went quiet: no new record
    for ``idle_timeout`` seconds since the first completed fetch. Pass ``drain``
    as the collector's progress hook and ``quiet`` as its condition."""

    def __init__(self, idle_timeout: float) -> None:
        self._idle_timeout = idle_timeout
        self._last_new: float | None = None  # set by the first completed fetch

    @abstractmethod
    def take(self, topic: str, rec: Collected) -> None:
        """One record, as it arrives."""

    def drain(self, c: Collector) -> None:
        now = time.monotonic()
        fresh = False
        for topic, bucket in c.records.items():
            for rec in bucket:
                self.take(topic, rec)
            fresh = fresh or bool(bucket)
            bucket.clear()
        if fresh or self._last_new is None:
            self._last_new = now

    def quiet(self, _: Collector) -> bool:
        last = self._last_new
        return last is not None and time.monotonic() - last >= self._idle_timeout
