"""The ingest ceiling: how fast Kafka and the client library hand records to Python.

A bare aiokafka consumer that decodes each value with msgpack and discards it.
No processor of the same records can beat it, so a worker's drain rate is read
against it (``infer-worker bench --model``, ``python -m bench.drain``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
from aiokafka import AIOKafkaConsumer


@dataclass
class Drain:
    name: str
    records: int
    seconds: float
    mean_batch: float = 0.0

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


async def drain_ceiling(
    bootstrap: str, topic: str, n: int, group: str, timeout: float = 600.0
) -> Drain:
    """Decode-and-discard ``n`` records of ``topic`` in a fresh group: fetch,
    ``msgpack.unpackb`` each value, nothing else; timed from the first fetch
    that returned records to the last. Raises TimeoutError when fewer than ``n``
    arrive within ``timeout`` seconds."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=10,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    await consumer.start()
    seen, first = 0, None
    deadline = time.monotonic() + timeout
    try:
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: {seen} of {n} records read in {timeout:.0f} s")
            fetched = await consumer.getmany(timeout_ms=200, max_records=10_000)
            if fetched and first is None:
                first = time.monotonic()
            for records in fetched.values():
                for record in records:
                    msgpack.unpackb(record.value, raw=False)
                seen += len(records)
        last = time.monotonic()
    finally:
        await consumer.stop()
    assert first is not None
    return Drain("ceiling", seen, last - first)
