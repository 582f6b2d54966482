"""The async stages against stand-ins for aiokafka's consumer and producer.

The stages themselves run for real; only the Kafka client objects they drive are
replaced, each by the smallest fake that keeps aiokafka's contract (the producer
fake refuses a record with neither key nor value, as aiokafka does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Any

from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import ConsumerRecord
from aiokafka.structs import TopicPartition as KafkaTP

from tests.models import cpu_stage, model_inputs
from worker.config import KafkaConfig, LimitsConfig, ModelConfig
from worker.contract import ErrorInfo, ModelInfo, decode_result
from worker.flow.lanes import LaneBackpressure
from worker.flow.messages import Answer, Batch, Completed, Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.commit import Committer
from worker.kafka.consumer import Consumer
from worker.kafka.delivery.at_least_once import AtLeastOnceWriter
from worker.kafka.delivery.writer import WriterParts
from worker.kafka.intake import JobFactory
from worker.kafka.listener import RebalanceListener

A = TopicPartition("in", 0)


class FakeGroup:
    """What the Committer needs from the consumer: an assignment and commit()."""

    def __init__(self) -> None:
        self.commits: list[dict[Any, int]] = []

    def assignment(self) -> set[Any]:
        return {KafkaTP(A.topic, A.partition)}

    async def commit(self, offsets: dict[Any, int]) -> None:
        self.commits.append(offsets)


class FakeBatch:
    """aiokafka's ``BatchBuilder``: collects records until closed."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes | None, bytes | None]] = []

    def append(
        self, *, timestamp: Any, key: bytes | None, value: bytes | None, headers: Any
    ) -> bool:
        assert not (value is None and key is None), "Need at least one: key or value"
        self.records.append((key, value))
        return True

    def close(self) -> None:
        pass


class FakeProducer:
    """aiokafka's ``send()`` and ``send_batch()``: enqueue and return the ack
    future. The first ``fail`` sends (a record or a batch) are not acknowledged
    (as when the broker is unreachable)."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.acked: list[tuple[str, bytes | None, bytes | None]] = []

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    def create_batch(self) -> FakeBatch:
        return FakeBatch()

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        return self._ack([(topic, k, v) for k, v in batch.records])

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Any = None,
    ) -> asyncio.Future[object]:
        assert not (value is None and key is None), "Need at least one: key or value"
        return self._ack([(topic, key, value)])

    def _ack(self, records: list[tuple[str, bytes | None, bytes | None]]) -> Any:
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.fail > 0:
            self.fail -= 1
            fut.set_exception(KafkaTimeoutError())
        else:
            self.acked.extend(records)
            fut.set_result(None)
        return fut


def make_sink(
    tracker: OffsetTracker, producer: FakeProducer
) -> tuple[AtLeastOnceWriter, asyncio.Queue[asyncio.Future[Completed] | None], Committer]:
    source: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue()
    committer = Committer(tracker, FakeGroup())
    parts = WriterParts(
        source, KafkaConfig(retry_backoff_ms=1), {"m": ModelInfo("m", "1")}, tracker, committer
    )
    sink = AtLeastOnceWriter(parts, max_pending_acks=2)
    sink._producing.producer = producer  # type: ignore[assignment]
    return sink, source, committer


def completed(*answers: Answer) -> asyncio.Future[Completed]:
    fut: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
    fut.set_result(Completed(seq=1, answers=tuple(answers), engine_rows=0))
    return fut


async def until_done(tracker: OffsetTracker, committer: Committer, tp: TopicPartition) -> None:
    """Wait, ack by ack, until every offset of ``tp`` is answered."""
    while tracker.in_flight(tp):
        await asyncio.wait_for(committer.progress(), 5)


async def test_failed_acks_are_redelivered_without_waiting_for_another_batch() -> None:
    """The last batch before traffic stops (or before backpressure pauses fetching)
    must still be redelivered: nothing else will come to trigger it."""
    tracker = OffsetTracker()
    epoch = tracker.track(A, 0, 10)
    job = Job(A, 0, b"k", arrived=time.monotonic(), deadline=None, epoch=epoch)
    answer = Answer(job, error=ErrorInfo("deadline_exceeded", "late"))
    producer = FakeProducer(fail=1)
    sink, source, committer = make_sink(tracker, producer)
    source.put_nowait(completed(answer))
    task = asyncio.create_task(sink.run())
    try:
        await until_done(tracker, committer, A)
        assert len(producer.acked) == 1 and tracker.committable() == {A: 1}
        # Re-sent as it was: a record that could not be queued in time (aiokafka's
        # KafkaTimeoutError while a partition has no leader) was never refused.
        result = decode_result(producer.acked[0][2] or b"")
        assert result.error is not None and result.error.code == "deadline_exceeded"
    finally:
        source.put_nowait(None)
        await asyncio.wait_for(task, 5)


async def test_record_with_neither_key_nor_value_goes_to_the_dlq() -> None:
    """A null-key tombstone on an input topic is undecodable; its DLQ copy must
    still be producible (aiokafka refuses a record with no key and no value),
    or the worker dies on it and crash-loops on every restart."""
    tracker = OffsetTracker()
    epoch = tracker.track(A, 0)
    job = JobFactory(model_inputs(), LimitsConfig())(A.topic, A.partition, 0, None, None,
                                                     epoch=epoch)  # fmt: skip
    producer = FakeProducer()
    sink, source, _ = make_sink(tracker, producer)
    source.put_nowait(completed(Answer(job)))
    source.put_nowait(None)
    await asyncio.wait_for(sink.run(), 5)
    assert [(t, k) for t, k, _ in producer.acked] == [("infer.dlq", None)]
    assert tracker.committable() == {A: 1}


class FakeConsumer:
    """What Consumer.run needs from AIOKafkaConsumer: one fetch, then nothing."""

    def __init__(self, records: Iterable[ConsumerRecord[bytes, bytes]]) -> None:
        self._fetches = [{KafkaTP(A.topic, A.partition): list(records)}]
        self.idle = asyncio.Event()  # set once the first fetch was fully handled

    async def getmany(
        self, *tps: KafkaTP, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[KafkaTP, list[Any]]:
        if self._fetches:
            return self._fetches.pop(0)
        self.idle.set()
        await asyncio.sleep(timeout_ms / 1000)
        return {}

    def assignment(self) -> set[KafkaTP]:
        return {KafkaTP(A.topic, A.partition)}

    def paused(self) -> set[KafkaTP]:
        return set()

    def pause(self, *tps: KafkaTP) -> None:
        pass

    def resume(self, *tps: KafkaTP) -> None:
        pass

    def highwater(self, tp: KafkaTP) -> int:
        return 1 << 40  # the log reaches past anything read


def record(offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(A.topic, A.partition, offset, 0, 0, None, b"x", None, 0, 1, ())


def make_source(
    jobs: asyncio.Queue[Job | None], tracker: OffsetTracker, consumer: FakeConsumer
) -> Consumer:
    async def forget(tps: set[TopicPartition]) -> None:
        tracker.forget(tps)

    source = Consumer(
        KafkaConfig(),
        JobFactory(model_inputs(), LimitsConfig()),
        {"": jobs},
        tracker,
        forget,
        LaneBackpressure(max_records=1000, max_bytes=1 << 30),
    )
    source.client = consumer  # type: ignore[assignment]
    return source


async def test_records_fetched_before_a_revocation_are_not_tracked_after_it() -> None:
    """The consume loop blocked on a full queue while the partition is revoked (and
    forgotten) must not track the rest of that fetch under a fresh epoch: those
    offsets would look owned, their watermark would be committed for a partition
    whose earlier offsets were never answered in that epoch."""
    tracker = OffsetTracker()
    jobs: asyncio.Queue[Job | None] = asyncio.Queue(maxsize=1)
    consumer = FakeConsumer(record(o) for o in range(5))
    source = make_source(jobs, tracker, consumer)
    task = asyncio.create_task(source.run())
    for _ in range(100):  # until the loop is blocked on the full queue
        if tracker.in_flight(A) == 2:
            break
        await asyncio.sleep(0)
    assert tracker.in_flight(A) == 2  # offset 0 queued, offset 1 waiting to be
    listener = RebalanceListener(source, source._on_revoke)
    await listener.on_partitions_revoked([KafkaTP(A.topic, A.partition)])
    received: list[int] = []

    async def drain() -> None:
        while (job := await jobs.get()) is not None:
            received.append(job.offset)

    drainer = asyncio.create_task(drain())
    await asyncio.wait_for(consumer.idle.wait(), 5)
    source.stop_fetching()
    await asyncio.wait_for(task, 5)
    await asyncio.wait_for(drainer, 5)
    assert received[:2] == [0, 1]  # the stale ones still flow; produce drops them
    assert tracker.in_flight(A) == 0 and A not in tracker.partitions()


class RebalancingConsumer(FakeConsumer):
    """aiokafka's getmany() during a rebalance: it waits for the new assignment,
    then returns records of that new assignment."""

    def __init__(self, records: Iterable[ConsumerRecord[bytes, bytes]]) -> None:
        super().__init__(records)
        self.fetching = asyncio.Event()
        self.assigned = asyncio.Event()

    async def getmany(
        self, *tps: KafkaTP, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[KafkaTP, list[Any]]:
        if self._fetches:
            self.fetching.set()
            await self.assigned.wait()
        return await super().getmany(*tps, timeout_ms=timeout_ms)


async def test_records_of_the_new_assignment_are_tracked_after_a_revocation() -> None:
    """A fetch issued before a revocation returns the new assignment's records:
    dropping them would lose them (the consumer's position is already past them)."""
    tracker = OffsetTracker()
    jobs: asyncio.Queue[Job | None] = asyncio.Queue()
    consumer = RebalancingConsumer(record(o) for o in range(3))
    source = make_source(jobs, tracker, consumer)
    task = asyncio.create_task(source.run())
    await asyncio.wait_for(consumer.fetching.wait(), 5)
    listener = RebalanceListener(source, source._on_revoke)
    await listener.on_partitions_revoked([KafkaTP(A.topic, A.partition)])
    consumer.assigned.set()
    await asyncio.wait_for(consumer.idle.wait(), 5)
    source.stop_fetching()
    await asyncio.wait_for(task, 5)
    assert tracker.in_flight(A) == 3 and jobs.qsize() == 4  # three jobs, end of stream


async def test_cancelled_consume_stage_does_not_block_on_a_full_queue() -> None:
    """Cancellation (drain deadline passed, second signal) must end the task even
    when nobody reads its output queue any more, or stop() hangs forever."""
    tracker = OffsetTracker()
    jobs: asyncio.Queue[Job | None] = asyncio.Queue(maxsize=1)
    consumer = FakeConsumer(record(o) for o in range(3))
    task = asyncio.create_task(make_source(jobs, tracker, consumer).run())
    for _ in range(100):
        if jobs.full():
            break
        await asyncio.sleep(0)
    assert jobs.full()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    try:
        assert task in done, "the cancelled consume task is stuck putting end-of-stream"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_cancelled_inference_stage_does_not_block_on_a_full_queue() -> None:
    batches: asyncio.Queue[Batch[Job] | None] = asyncio.Queue()
    out: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue(maxsize=1)
    out.put_nowait(completed())  # produce is gone: nobody takes this one
    stage = cpu_stage(ModelConfig(), batches_in=batches, completed_out=out, max_batch_size=4)
    task = asyncio.create_task(stage.run())
    await asyncio.sleep(0)  # blocked on its (empty) input queue
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    try:
        assert task in done, "the cancelled inference task is stuck putting end-of-stream"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        stage.close()


class UnreachableGroup(FakeGroup):
    """aiokafka's commit() while the broker is unreachable: it retries the
    coordinator lookup and retriable errors forever and never returns."""

    async def commit(self, offsets: dict[Any, int]) -> None:
        await asyncio.Event().wait()


async def test_commit_is_bounded_when_the_broker_is_unreachable() -> None:
    """Worker.stop() ends with a commit: unbounded, SIGTERM never exits."""
    tracker = OffsetTracker()
    tracker.done(A, 0, tracker.track(A, 0))
    committer = Committer(tracker, UnreachableGroup(), timeout=0.05)
    assert await asyncio.wait_for(committer.commit_now(), 2) is False
    assert tracker.committable() == {A: 1}  # still to be committed later


def test_fetch_backoff_is_capped_however_long_the_outage() -> None:
    """0.1 * 2**n overflows a float at n = 1024 (about 85 minutes of failed fetches
    at the 5 s cap): the consume stage must keep retrying, not die."""
    from worker.kafka.consumer import fetch_backoff

    backoff = fetch_backoff()
    delays = [backoff.next() for _ in range(5000)]
    assert delays[0] == 0.2
    assert delays[5] == 5.0
    assert delays[4999] == 5.0


async def test_stopped_committer_makes_no_further_commit() -> None:
    """stop() follows Worker.stop()'s own final commit; one more attempt from the
    commit loop only adds a commit timeout to shutdown while the broker is down."""
    tracker = OffsetTracker()
    group = FakeGroup()
    committer = Committer(tracker, group)
    task = asyncio.create_task(committer.run())
    await asyncio.sleep(0)  # the loop waits for work
    tracker.done(A, 0, tracker.track(A, 0))
    committer.stop()
    await asyncio.wait_for(task, 5)
    assert group.commits == []


async def test_commits_within_the_interval_join_one_commit() -> None:
    """kafka.commit_interval_ms: acknowledgements that arrive within the interval
    after a commit are carried by one more commit at its end, never one each; an
    explicit commit_now (revocation, shutdown) does not wait for it."""
    tracker = OffsetTracker()
    group = FakeGroup()
    committer = Committer(tracker, group, interval=0.3)
    task = asyncio.create_task(committer.run())
    try:
        for offset in range(6):
            tracker.done(A, offset, tracker.track(A, offset))
            committer.notify()
            await asyncio.sleep(0.02)
        assert [c[KafkaTP(A.topic, A.partition)] for c in group.commits] == [1]
        await asyncio.sleep(0.4)
        assert [c[KafkaTP(A.topic, A.partition)] for c in group.commits] == [1, 6]
        tracker.done(A, 6, tracker.track(A, 6))
        assert await committer.commit_now()
        assert [c[KafkaTP(A.topic, A.partition)] for c in group.commits] == [1, 6, 7]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class CountingProducer(FakeProducer):
    """Counts record batches handed over (one per output partition per send)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        self.batches.append(len(batch.records))
        return await super().send_batch(batch, topic, partition=partition)


async def test_batches_completed_together_are_sent_together_in_order() -> None:
    """Completed batches already waiting behind the one awaited go out with it,
    in one record batch (one produce request), never waiting for one that has
    not completed; records keep their order and every offset is settled."""
    tracker = OffsetTracker()
    epoch = tracker.track(A, 0, 10)
    for offset in range(1, 8):
        tracker.track(A, offset, 10)

    def answer(offset: int) -> Answer:
        job = Job(A, offset, f"k{offset}".encode(), time.monotonic(), None, epoch=epoch)
        return Answer(job, error=ErrorInfo("deadline_exceeded", "late"))

    producer = CountingProducer()
    sink, source, committer = make_sink(tracker, producer)  # coalesces 2 batches at most
    for first in (0, 2, 4):
        source.put_nowait(completed(answer(first), answer(first + 1)))
    pending: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
    source.put_nowait(pending)
    task = asyncio.create_task(sink.run())
    try:
        while len(producer.acked) < 6:
            await asyncio.wait_for(committer.progress(), 5)  # notified after each ack
        assert producer.batches == [4, 2]  # [0-3] together, then [4, 5]: not waiting
        pending.set_result(completed(answer(6), answer(7)).result())
        await until_done(tracker, committer, A)
    finally:
        source.put_nowait(None)
        await asyncio.wait_for(task, 5)
    assert producer.batches == [4, 2, 2]
    assert [int(key.decode()[1:]) for _, key, _ in producer.acked if key] == list(range(8))
    assert tracker.committable() == {A: 8}


class SlowlyFailingProducer(FakeProducer):
    """The first batch's delivery fails only after a while (as a request timeout
    does, with the broker unreachable for that partition), while later batches
    are acknowledged at once."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        self.calls += 1
        if self.calls > 1:
            return self._ack([(topic, k, v) for k, v in batch.records])
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, fut.set_exception, KafkaTimeoutError())
        return fut


async def test_redelivery_after_a_late_failure_can_reorder_and_verify_reports_it() -> None:
    """Issue 10: the documented exception to per-partition order. Results in flight
    behind a batch whose delivery fails late reach the topic before it is re-sent;
    nothing is lost, the offsets commit only once all are acknowledged, and
    ``verify`` reports the step backwards."""
    from worker.ops.verify import InputRecord, Reply, check

    tracker = OffsetTracker()
    epoch = tracker.track(A, 0, 10)
    for offset in (1, 2, 3):
        tracker.track(A, offset, 10)

    def answer(offset: int) -> Answer:
        job = Job(A, offset, f"k{offset}".encode(), time.monotonic(), None, epoch=epoch)
        return Answer(job, error=ErrorInfo("deadline_exceeded", "late"))

    producer = SlowlyFailingProducer()
    sink, source, committer = make_sink(tracker, producer)
    source.put_nowait(completed(answer(0), answer(1)))
    # The second batch completes after the first was sent (completed batches
    # waiting together would be sent together, in order).
    later: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, later.set_result,
                                          completed(answer(2), answer(3)).result())  # fmt: skip
    source.put_nowait(later)
    task = asyncio.create_task(sink.run())
    try:
        await until_done(tracker, committer, A)
    finally:
        source.put_nowait(None)
        await asyncio.wait_for(task, 5)
    order = [int(key.decode()[1:]) for _, key, _ in producer.acked if key]
    assert sorted(order) == [0, 1, 2, 3] and order == [2, 3, 0, 1]
    assert tracker.committable() == {A: 4}
    replies = [Reply(InputRecord(A.topic, 0, o), 0, i, "result") for i, o in enumerate(order)]
    report = check({A.topic: {0: [0, 1, 2, 3]}}, replies)
    assert report.ok and report.totals.ordering_violations == 1
