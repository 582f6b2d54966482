"""A partition is read only from the position the worker decided (issue 35).

The consume stage runs for real against a stand-in for aiokafka's consumer that
keeps its contract where positioning is concerned: a partition's log and a fetch
position, ``pause`` (getmany returns nothing of a paused partition), ``seek`` (the
next fetch starts there), the committed offset, and the log's highwater.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka.structs import ConsumerRecord
from aiokafka.structs import TopicPartition as KafkaTP

from tests.models import model_inputs
from worker.config import KafkaConfig, LimitsConfig
from worker.flow.lanes import LaneBackpressure
from worker.flow.messages import Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.consumer import Consumer
from worker.kafka.intake import JobFactory
from worker.kafka.listener import RebalanceListener
from worker.obs import metrics

A = TopicPartition("in", 0)
KA = KafkaTP(A.topic, A.partition)


def record(offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(A.topic, A.partition, offset, 0, 0, None, b"x", None, 0, 1, ())


class Pausing:
    """aiokafka's pause state: the partitions paused, changed by pause/resume."""

    _paused: set[KafkaTP]

    def paused(self) -> set[KafkaTP]:
        return set(self._paused)

    def pause(self, *tps: KafkaTP) -> None:
        self._paused.update(tps)

    def resume(self, *tps: KafkaTP) -> None:
        self._paused.difference_update(tps)


class LogConsumer(Pausing):
    """One partition of ``length`` records, committed at ``committed``; the fetch
    position starts where aiokafka would put it by itself (``position``)."""

    def __init__(self, length: int, committed: int, position: int) -> None:
        self.log = [record(o) for o in range(length)]
        self.highwater_ = length
        self.fetch_at = position
        self._committed = committed
        self._paused: set[KafkaTP] = set()
        self.fetches_while: list[str] = []  # what each fetch returned during a restore
        self.restoring = False

    async def getmany(
        self, *tps: KafkaTP, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[KafkaTP, list[Any]]:
        await asyncio.sleep(0.001)
        if KA in self._paused or self.fetch_at >= len(self.log):
            if self.restoring:
                self.fetches_while.append("nothing")
            return {}
        batch = self.log[self.fetch_at : self.fetch_at + 3]
        self.fetch_at += len(batch)
        if self.restoring:
            self.fetches_while.append("records")
        return {KA: batch}

    def assignment(self) -> set[KafkaTP]:
        return {KA}

    async def committed(self, tp: KafkaTP) -> int:
        return self._committed

    def seek(self, tp: KafkaTP, offset: int) -> None:
        self.fetch_at = offset

    async def seek_to_beginning(self, *tps: KafkaTP) -> None:
        self.fetch_at = 0

    def highwater(self, tp: KafkaTP) -> int:
        return self.highwater_


def source_on(consumer: LogConsumer, jobs: asyncio.Queue[Job | None]) -> Consumer:
    tracker = OffsetTracker()

    async def forget(tps: set[TopicPartition]) -> None:
        tracker.forget(tps)

    source = Consumer(
        KafkaConfig(), JobFactory(model_inputs(), LimitsConfig()), {"": jobs}, tracker, forget,
        LaneBackpressure(max_records=1000, max_bytes=1 << 30),
    )  # fmt: skip
    source.client = consumer  # type: ignore[assignment]
    return source


async def offsets_queued(jobs: asyncio.Queue[Job | None], until: int) -> list[int]:
    out: list[int] = []
    while not out or out[-1] < until:
        job = await asyncio.wait_for(jobs.get(), 5)
        assert job is not None
        out.append(job.offset)
    return out


async def test_a_partition_is_not_fetched_while_its_states_are_restored() -> None:
    """The member restarted with its instance id: aiokafka positions the partition
    at the committed offset by itself and would fetch while the restore is awaited;
    the worker's seek then had the same records fetched again (issue 35). Paused
    until positioned, every record is queued once, after the restore."""
    consumer = LogConsumer(length=10, committed=2, position=2)
    jobs: asyncio.Queue[Job | None] = asyncio.Queue()
    source = source_on(consumer, jobs)
    release = asyncio.Event()
    restored: list[list[TopicPartition]] = []

    async def restore(tps: list[TopicPartition]) -> None:
        consumer.restoring = True
        await release.wait()  # the fetch loop runs meanwhile
        restored.append(tps)
        consumer.restoring = False

    source.restore_with(restore)
    task = asyncio.create_task(source.run())
    listener = RebalanceListener(source, source._on_revoke)
    assigning = asyncio.create_task(listener.on_partitions_assigned([KA]))
    try:
        for _ in range(200):  # the fetch loop polls while the restore is awaited
            if len(consumer.fetches_while) >= 3 or not jobs.empty():
                break
            await asyncio.sleep(0.005)
        assert jobs.empty(), "a record was queued before its sequences were restored"
        assert set(consumer.fetches_while) == {"nothing"}, "fetched while restoring"
        release.set()
        await asyncio.wait_for(assigning, 5)
        assert restored == [[A]] and consumer.paused() == set()
        assert await offsets_queued(jobs, until=9) == list(range(2, 10))
    finally:
        release.set()
        source.stop_fetching()
        await asyncio.wait_for(asyncio.gather(task, assigning, return_exceptions=True), 5)


async def test_records_fetched_before_the_partition_was_positioned_are_dropped() -> None:
    """A fetch that returned before the assignment listener paused the partition
    (from a position aiokafka chose) is not queued: the partition is read again
    from the decided offset, each record once."""
    consumer = LogConsumer(length=8, committed=3, position=5)
    jobs: asyncio.Queue[Job | None] = asyncio.Queue()
    source = source_on(consumer, jobs)
    [(stamp, early)] = await source._fetch(consumer, 0)  # type: ignore[arg-type]
    assert [r.offset for r in early[KA]] == [5, 6, 7]
    await RebalanceListener(source, source._on_revoke).on_partitions_assigned([KA])
    await source._enqueue(KA, early[KA], stamp)
    assert jobs.empty()
    task = asyncio.create_task(source.run())
    assert await offsets_queued(jobs, until=7) == [3, 4, 5, 6, 7]
    source.stop_fetching()
    await asyncio.wait_for(task, 5)


async def test_a_second_delivery_is_dropped_and_counted_a_shorter_log_is_a_reset() -> None:
    consumer = LogConsumer(length=6, committed=0, position=0)
    jobs: asyncio.Queue[Job | None] = asyncio.Queue()
    source = source_on(consumer, jobs)
    await RebalanceListener(source, source._on_revoke).on_partitions_assigned([KA])
    [(stamp, first)] = await source._fetch(consumer, 0)  # type: ignore[arg-type]
    await source._enqueue(KA, first[KA], stamp)
    before = metrics.REDELIVERIES_DROPPED._value.get()
    await source._enqueue(KA, [record(1), record(2), record(3)], stamp)  # 1, 2 again
    assert metrics.REDELIVERIES_DROPPED._value.get() - before == 2
    assert [jobs.get_nowait().offset for _ in range(jobs.qsize())] == [0, 1, 2, 3]
    consumer.highwater_ = 2  # the broker's log now ends below what was read: a reset
    resets = metrics.PARTITION_RESETS._value.get()
    await source._enqueue(KA, [record(0), record(1)], stamp)
    assert metrics.PARTITION_RESETS._value.get() - resets == 1
    assert [jobs.get_nowait().offset for _ in range(jobs.qsize())] == [0, 1]
