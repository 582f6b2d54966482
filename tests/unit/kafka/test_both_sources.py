"""Waiting on the group consumer and the urgent lane's own fetcher at once
(``worker.kafka.urgentfetch.BothSources``): no fetched record is lost to a wait
cancelled mid-way, each source's records only for the partitions it reads, a
failure never hides the other source's records.

The sources are stand-ins that hand out what a test puts in their queues, as
``getmany`` does (records taken once, returned by the call that took them)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import TopicPartition as KafkaTP

from worker.config import KafkaConfig
from worker.kafka.readable import Fetched
from worker.kafka.urgentfetch import BothSources, UrgentFetcher

URGENT, BULK = KafkaTP("urgent", 0), KafkaTP("bulk", 0)


class Source:
    """What a test puts in, handed out by ``getmany`` (one put per call)."""

    def __init__(self, held: set[KafkaTP] | None = None) -> None:
        self.queue: asyncio.Queue[Fetched | BaseException] = asyncio.Queue()
        self.held = held or set()
        self.calls = 0

    def holds(self, tp: KafkaTP) -> bool:
        return tp in self.held

    async def getmany(self, timeout_ms: int) -> Fetched:
        self.calls += 1
        try:
            got = await asyncio.wait_for(self.queue.get(), timeout_ms / 1000.0)
        except TimeoutError:
            return {}
        if isinstance(got, BaseException):
            raise got
        return got


def records(tp: KafkaTP, *offsets: int) -> Fetched:
    return {tp: [f"{tp.topic}@{o}" for o in offsets]}  # type: ignore[list-item]


def sources() -> tuple[BothSources, Source, Source, list[int]]:
    group, fetcher = Source(), Source(held={URGENT})
    stamp = [0]
    both = BothSources(group.getmany, fetcher, lambda: stamp[0])  # type: ignore[arg-type]
    return both, group, fetcher, stamp


def offsets(got: list[tuple[int, Fetched]]) -> list[Any]:
    return [r for _, fetched in got for recs in fetched.values() for r in recs]


async def test_the_group_wait_is_kept_while_the_urgent_one_returns() -> None:
    both, group, fetcher, _ = sources()
    fetcher.queue.put_nowait(records(URGENT, 1))
    assert offsets(await both.next(1000)) == ["urgent@1"]
    group.queue.put_nowait(records(BULK, 7, 8))
    fetcher.queue.put_nowait(records(URGENT, 2))
    got = offsets(await both.next(1000))
    await asyncio.sleep(0)
    got += offsets(both.done())
    # The group's first wait was not cancelled: its records came, and only one
    # wait was ever made on it.
    assert sorted(got) == ["bulk@7", "bulk@8", "urgent@2"]
    assert group.calls == 1


async def test_results_already_in_are_taken_without_waiting() -> None:
    both, group, fetcher, stamp = sources()
    fetcher.queue.put_nowait(records(URGENT, 1))
    assert offsets(await both.next(1000)) == ["urgent@1"]
    assert both.done() == []  # the group's wait is still pending
    stamp[0] = 5
    group.queue.put_nowait(records(BULK, 2))
    await asyncio.sleep(0.01)  # the group's wait takes them meanwhile
    got = both.done()
    assert [s for s, _ in got] == [5]  # stamped when its wait completed
    assert offsets(got) == ["bulk@2"]


async def test_each_source_only_for_the_partitions_it_reads() -> None:
    both, group, fetcher, _ = sources()
    group.queue.put_nowait({**records(BULK, 3), **records(URGENT, 9)})
    got = await both.next(1000)
    assert offsets(got) == ["bulk@3"]  # the group's urgent record: the fetcher reads it
    fetcher.held.clear()  # taken back (a revocation began)
    fetcher.queue.put_nowait(records(URGENT, 10))
    await asyncio.sleep(0.01)  # the fetcher's pending wait takes it
    assert fetcher.queue.empty()
    assert offsets(both.done()) == []  # fetched before it was taken back: dropped
    both.cancel()


async def test_a_failure_does_not_hide_the_other_sources_records() -> None:
    both, group, fetcher, _ = sources()
    group.queue.put_nowait(records(BULK, 1))
    fetcher.queue.put_nowait(KafkaConnectionError())
    await asyncio.sleep(0.01)
    got = await both.next(1000)
    await asyncio.sleep(0.01)
    got += both.done()
    assert offsets(got) == ["bulk@1"]
    fetcher.queue.put_nowait(KafkaConnectionError())
    with pytest.raises(KafkaConnectionError):
        await both.next(1000)
    both.cancel()


async def test_a_fetcher_without_partitions_waits_its_timeout() -> None:
    fetcher = UrgentFetcher(KafkaConfig())  # not started: no partitions to read
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await fetcher.getmany(50) == {}
    assert loop.time() - started >= 0.045
