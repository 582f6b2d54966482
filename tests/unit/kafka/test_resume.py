"""Resuming at the acknowledgement: while every lane is paused the consumer
waits for the next acknowledgement (``Committer.progress``), not in a fetch
that cannot be cut short, and fetches again as soon as one brings what is in
flight down to the resume level. Against the stand-in for aiokafka's consumer
of ``test_stages`` (here one that returns nothing from a paused partition)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.lanes import LaneBackpressure
from worker.flow.messages import Job
from worker.flow.offsets import OffsetTracker
from worker.kafka.commit import Committer
from worker.kafka.lanefetch import fetch_timeout_ms

from .test_positioning import Pausing
from .test_stages import A, FakeConsumer, FakeGroup, make_source, record


class PausingConsumer(Pausing, FakeConsumer):
    """Keeps aiokafka's pause: nothing from a paused partition; every fetch's
    wait recorded, with whether the partition was paused then."""

    def __init__(self) -> None:
        super().__init__([record(0), record(1)])
        self._fetches.append({KafkaTP(A.topic, A.partition): [record(2), record(3)]})
        self._paused: set[KafkaTP] = set()
        self.waits: list[tuple[int, bool]] = []

    async def getmany(
        self, *tps: KafkaTP, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[KafkaTP, list[Any]]:
        paused = bool(self._paused)
        self.waits.append((timeout_ms, paused))
        if paused:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        return await super().getmany(*tps, timeout_ms=timeout_ms)


async def test_every_lane_paused_waits_for_the_acknowledgement_not_in_a_fetch() -> None:
    tracker = OffsetTracker()
    jobs: asyncio.Queue[Job | None] = asyncio.Queue()
    consumer = PausingConsumer()
    source = make_source(jobs, tracker, consumer)
    source.pausing.backpressure = LaneBackpressure(max_records=2, max_bytes=1 << 30)
    committer = Committer(tracker, FakeGroup())
    source.wake_on(committer.progress)
    task = asyncio.create_task(source.run())
    try:
        first = [await asyncio.wait_for(jobs.get(), 5) for _ in range(2)]
        await asyncio.sleep(0.12)  # paused (2 in flight) for a while: two 50 ms polls
        assert consumer.paused()
        polls = len(consumer.waits)
        deadline = time.monotonic() + 5
        for _ in range(10_000_000):  # until a poll just began (at most 50 ms away)
            if len(consumer.waits) > polls or time.monotonic() > deadline:
                break
            await asyncio.sleep(0)
        for _ in range(5):  # it ended, and the wait for an acknowledgement began
            await asyncio.sleep(0)
        assert len(consumer.waits) == polls + 1
        for job in first:  # both answered and acknowledged
            assert job is not None
            tracker.done(job.tp, job.offset, job.epoch)
        committer.notify()
        # Resumed and fetched within a few turns of the loop (no time passes),
        # not after the rest of a 50 ms wait.
        for _ in range(100):
            if jobs.qsize() == 2:
                break
            await asyncio.sleep(0)
        assert jobs.qsize() == 2, consumer.waits
        second = [jobs.get_nowait() for _ in range(2)]
        assert [j.offset for j in second if j is not None] == [2, 3]
    finally:
        source.stop_fetching()
        await asyncio.wait_for(task, 5)
    waits_paused = [ms for ms, paused in consumer.waits if paused]
    assert waits_paused and set(waits_paused) == {0}, consumer.waits


def test_the_fetch_waits_less_the_more_is_paused() -> None:
    bp = LaneBackpressure(max_records=10, max_bytes=1 << 30, lanes=2)
    assert fetch_timeout_ms(bp) == 200
    bp.update(10, 0)  # the lower lane pauses at the bound
    assert bp.paused and not bp.all_paused and fetch_timeout_ms(bp) == 50
    bp.update(15, 0)  # the urgent lane at 1.5 times it
    assert bp.all_paused and fetch_timeout_ms(bp) == 0
