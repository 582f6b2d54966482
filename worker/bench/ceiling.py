"""The ingest ceiling: how fast Kafka and the client library hand records to Python.

A bare aiokafka consumer that decodes each value with msgpack and discards it.
No processor of the same records can beat it, so a worker's drain rate is read
against it (``infer-worker bench --model``, ``python -m benchmarks.drain``).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


async def drain_ceiling(
    bootstrap: Connection,
    topic: str,
    n: int,
    timeout: float = 600.0,
    readers: int = 1,
    per_partition: Mapping[int, int] | None = None,
) -> Drain:
    """Decode-and-discard ``n`` records of ``topic``: fetch, ``msgpack.unpackb``
    each value, nothing else. The consumer is assigned every partition (no
    group: joining one takes seconds that say nothing about ingest) and timed
    from just before its first fetch to the last record, so every record it
    counts was fetched and decoded while the clock ran. Timing from the first
    fetch's return instead, as this did before, counted records fetched before
    the clock started: up to ``max_partition_fetch_bytes`` per partition, the
    whole of a small backlog. Raises TimeoutError when fewer than ``n`` arrive
    within ``timeout`` seconds.

    ``readers`` > 1: as many processes read at once, each its share of the
    partitions (round robin), started together at a barrier once each is
    assigned and positioned, and timed from the barrier to the last record of
    any (``time.monotonic`` is one clock for the host's processes on Linux):
    the ceiling a worker of that many members is read against.
    ``per_partition``: each partition's records (how ``n`` lies across them)."""
    if readers > 1:
        assert per_partition is not None, "readers > 1 need each partition's records"
        return await _drain_in_processes(bootstrap, topic, readers, per_partition, timeout)
    consumer = _consumer(bootstrap)
    await consumer.start()
    try:
        partitions = sorted(await topic_partitions(consumer, topic))
        if not partitions:
            raise ValueError(f"{topic}: no such topic")
        await _assigned(consumer, topic, partitions)
        first = time.monotonic()
        seen = await _read(consumer, topic, n, first + timeout, timeout)
        last = time.monotonic()
    finally:
        await consumer.stop()
    return Drain("ceiling", seen, last - first)


def _consumer(bootstrap: Connection) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        **connect_kwargs(bootstrap),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=10,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )


async def _assigned(consumer: AIOKafkaConsumer, topic: str, partitions: Sequence[int]) -> None:
    assigned = [TopicPartition(topic, p) for p in partitions]
    consumer.assign(assigned)
    await consumer.seek_to_beginning(*assigned)


async def _read(
    consumer: AIOKafkaConsumer, topic: str, n: int, deadline: float, timeout: float
) -> int:
    """Fetch and decode until ``n`` records are read (TimeoutError past ``deadline``)."""
    seen = 0
    while seen < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic}: {seen} of {n} records read in {timeout:.0f} s")
        fetched = await consumer.getmany(timeout_ms=200, max_records=10_000)
        for records in fetched.values():
            for record in records:
                msgpack.unpackb(record.value, raw=False)
            seen += len(records)
    return seen


async def _drain_in_processes(
    bootstrap: Connection, topic: str, readers: int, per_partition: Mapping[int, int],
    timeout: float,
) -> Drain:  # fmt: skip
    partitions = sorted(per_partition)
    readers = max(1, min(readers, len(partitions)))
    shares = [partitions[k::readers] for k in range(readers)]
    # spawn, not fork: this process runs an event loop and client threads.
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(readers)
    results: Any = context.Queue()
    processes = [
        context.Process(target=_read_share, daemon=True, args=(
            bootstrap, topic, share, sum(per_partition[p] for p in share), timeout, barrier,
            results))
        for share in shares
    ]  # fmt: skip
    for process in processes:
        process.start()
    try:
        done = await asyncio.to_thread(_collect, results, readers, timeout + 60.0)
    finally:
        barrier.abort()
        for process in processes:
            process.kill()
            process.join()
    first, last = min(d[0] for d in done), max(d[1] for d in done)
    return Drain(f"ceiling x{readers}", sum(d[2] for d in done), last - first)


def _collect(results: Any, readers: int, timeout: float) -> list[tuple[float, float, int]]:
    out = []
    for _ in range(readers):
        try:
            outcome, detail = results.get(timeout=timeout)
        except queue.Empty as exc:
            raise TimeoutError(f"a ceiling reader did not finish within {timeout:.0f} s") from exc
        if outcome == "error":
            raise RuntimeError(f"a ceiling reader failed: {detail}")
        out.append(detail)
    return out


def _read_share(
    bootstrap: Connection, topic: str, partitions: list[int], n: int, timeout: float,
    barrier: Any, results: Any,
) -> None:  # fmt: skip
    """One reader process: assigned and positioned, then waits for the others,
    reads its ``n`` records and puts (start, end, records) on ``results``."""

    async def go() -> tuple[float, float, int]:
        consumer = _consumer(bootstrap)
        await consumer.start()
        try:
            await _assigned(consumer, topic, partitions)
            await asyncio.to_thread(barrier.wait, timeout)
            first = time.monotonic()
            seen = await _read(consumer, topic, n, first + timeout, timeout)
            return first, time.monotonic(), seen
        finally:
            await consumer.stop()

    try:
        results.put(("ok", asyncio.run(go())))
    except BaseException as exc:  # boundary: reported to the bench, which stops the run
        barrier.abort()
        results.put(("error", repr(exc)))
