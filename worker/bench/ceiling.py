"""The ingest ceiling: how fast Kafka and the client library hand records to Python.

A bare aiokafka consumer that decodes each value with msgpack and discards it.
No processor of the same records can beat it, so a worker's drain rate is read
against it (``infer-worker bench --model``, ``python -m benchmarks.drain``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgpack
from aiokafka import AIOKafkaConsumer, TopicPartition

from worker.kafka.clients import topic_partitions
from worker.kafka.credentials import Connection, connect_kwargs


def arrivals_after(times: Iterable[float], start: float) -> int:
    """How many of ``times`` fall after ``start``. A drain's rate counts what
    arrived while its clock ran; a worker's clock starts at its first result,
    and the results of that instant (a whole batch) came before any interval."""
    return sum(1 for t in times if t > start)


@dataclass
class Drain:
    name: str
    records: int
    seconds: float
    mean_batch: float = 0.0
    padding: float = 0.0  # padding / data elements of inputs with free dimensions
    # CPU the processor's processes spent per record while results arrived (0 =
    # not measured): its cost per core, apart from what else shares the machine.
    cpu_us_per_record: float = 0.0
    # The whole machine's CPU per record over the same window (the broker's and
    # the bench's too), and its busy share: near 1.0, the machine binds the rate.
    host_us_per_record: float = 0.0
    host_busy: float = 0.0

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


async def drain_ceiling(bootstrap: Connection, topic: str, n: int, timeout: float = 600.0) -> Drain:
    """Decode-and-discard ``n`` records of ``topic``: fetch, ``msgpack.unpackb``
    each value, nothing else. The consumer is assigned every partition (no
    group: joining one takes seconds that say nothing about ingest) and timed
    from just before its first fetch to the last record, so every record it
    counts was fetched and decoded while the clock ran. Timing from the first
    fetch's return instead, as this did before, counted records fetched before
    the clock started: up to ``max_partition_fetch_bytes`` per partition, the
    whole of a small backlog. Raises TimeoutError when fewer than ``n`` arrive
    within ``timeout`` seconds."""
    consumer = AIOKafkaConsumer(
        **connect_kwargs(bootstrap),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=10,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    await consumer.start()
    seen = 0
    try:
        partitions = sorted(await topic_partitions(consumer, topic))
        if not partitions:
            raise ValueError(f"{topic}: no such topic")
        assigned = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(assigned)
        await consumer.seek_to_beginning(*assigned)
        first = time.monotonic()
        deadline = first + timeout
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: {seen} of {n} records read in {timeout:.0f} s")
            fetched = await consumer.getmany(timeout_ms=200, max_records=10_000)
            for records in fetched.values():
                for record in records:
                    msgpack.unpackb(record.value, raw=False)
                seen += len(records)
        last = time.monotonic()
    finally:
        await consumer.stop()
    return Drain("ceiling", seen, last - first)
