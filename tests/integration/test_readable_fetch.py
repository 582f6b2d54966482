"""A paused partition's fetched records stay fetched, against a real broker
(``worker.kafka.readable``): aiokafka drops them whenever a ``getmany`` covers
the paused partition, and fetches them again after the resume. The worker pauses
at its in-flight bound with most partitions' next fetch buffered, so a plain
``getmany()`` made a drain fetch its records' bytes 4.6 times (BENCHMARKS.md,
"Fetched once")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition as KafkaTP

from worker.kafka.clients import started
from worker.kafka.credentials import connect_kwargs
from worker.kafka.readable import getmany_readable
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import produce_all

pytestmark = pytest.mark.integration

N, FIRST = 300, 10


@asynccontextmanager
async def buffered(
    broker: Broker, names: dict[str, str]
) -> AsyncIterator[tuple[AIOKafkaConsumer, KafkaTP]]:
    """A consumer of a one-partition topic of N records that took the first
    FIRST: one fetch brought all N (well under 1 MiB), the rest are buffered."""
    topic = names["requests"]
    await create_topics(broker.bootstrap, {topic: 1})
    await produce_all(broker.bootstrap, topic, [(b"k", b"x" * 64) for _ in range(N)])
    tp = KafkaTP(topic, 0)
    consumer = AIOKafkaConsumer(
        **connect_kwargs(broker.bootstrap), enable_auto_commit=False,
        auto_offset_reset="earliest", max_partition_fetch_bytes=1 << 20,
    )  # fmt: skip
    consumer.assign([tp])
    await started(consumer)
    try:
        first = await getmany_readable(consumer, 10_000, max_records=FIRST)
        assert [r.offset for r in first[tp]] == list(range(FIRST))
        yield consumer, tp
    finally:
        await consumer.stop()


@pytest.mark.parametrize("readable", [True, False], ids=["readable-only", "plain-getmany"])
async def test_a_paused_partitions_fetched_records_wait_for_the_resume(
    broker: Broker, names: dict[str, str], readable: bool
) -> None:
    async with buffered(broker, names) as (consumer, tp):
        consumer.pause(tp)
        for timeout_ms in (0, 100, 0):  # polls while paused (the member's liveness)
            if readable:
                assert await getmany_readable(consumer, timeout_ms) == {}
            else:
                assert await consumer.getmany(timeout_ms=timeout_ms) == {}
        consumer.resume(tp)
        at_once = await consumer.getmany(timeout_ms=0)
        if readable:  # the buffered records, without a fetch
            assert [r.offset for r in at_once[tp]] == list(range(FIRST, N))
        else:  # dropped while paused: fetched again
            assert at_once == {}
            offsets: list[int] = []
            while len(offsets) < N - FIRST:
                got = await consumer.getmany(timeout_ms=10_000)
                assert got, f"only {len(offsets)} of {N - FIRST} fetched again"
                offsets += [r.offset for r in got[tp]]
            assert offsets == list(range(FIRST, N))


async def test_a_partition_resumed_during_the_wait_is_read_in_that_wait(
    broker: Broker, names: dict[str, str]
) -> None:
    """The partitions named are decided again as the wait goes on: records of a
    partition resumed while it waits come back in that call (an urgent lane
    resumed during its fetcher's wait), not after the wait ran out empty."""
    async with buffered(broker, names) as (consumer, tp):
        consumer.pause(tp)
        waiting = asyncio.ensure_future(getmany_readable(consumer, 30_000))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing readable: it waits
        consumer.resume(tp)
        got = await asyncio.wait_for(waiting, 10)  # the rest, long before its 30 s
        assert [r.offset for r in got[tp]] == list(range(FIRST, N))
