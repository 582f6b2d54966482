"""The exactly-once sink against a stand-in for aiokafka's transactional producer
that keeps its contract: records and offsets are staged in the open transaction,
written on commit and dropped on abort; a record refused for good breaks the
producer's sequence for every later batch. The real producer against Apache
Kafka is exercised in tests/faults/test_exactly_once.py and
tests/integration/test_producer_safety.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError, OutOfOrderSequenceNumber, ProducerFenced

from worker.config import KafkaConfig
from worker.contract import ErrorInfo, ModelInfo, decode_result
from worker.flow.errors import TransactionFenced
from worker.flow.messages import Answer, Completed, Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.commit import Committer
from worker.kafka.delivery.exactly_once import ExactlyOnceWriter
from worker.kafka.delivery.writer import WriterParts
from worker.obs import metrics

from .test_stages import FakeBatch, FakeGroup

A = TopicPartition("in", 0)


@dataclass
class Cluster:
    """What readers of committed data see."""

    log: list[bytes] = field(default_factory=list)  # read_committed view of the output
    offsets: dict[Any, int] = field(default_factory=dict)  # the group's committed offsets
    transactions: int = 0
    limit: int = 1 << 20  # the largest record value the topic takes


class TxnProducer:
    def __init__(self, cluster: Cluster, fence_on_commit: bool = False) -> None:
        self.cluster = cluster
        self.fence_on_commit = fence_on_commit
        self.in_txn = False
        self.staged: list[bytes] = []
        self.staged_offsets: dict[Any, int] = {}
        self.broken = False
        self.stopped = False
        self.aborts = 0

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    def create_batch(self) -> FakeBatch:
        return FakeBatch()

    async def begin_transaction(self) -> None:
        assert not self.in_txn
        self.in_txn = True

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        return self._stage([v or b"" for _, v in batch.records])

    async def send(
        self, topic: str, value: bytes | None = None, key: bytes | None = None, headers: Any = None
    ) -> asyncio.Future[object]:
        return self._stage([value or b""])

    def _stage(self, values: list[bytes]) -> asyncio.Future[object]:
        assert self.in_txn, "a transactional producer sends nothing outside a transaction"
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.broken:
            fut.set_exception(OutOfOrderSequenceNumber())
        elif any(len(v) > self.cluster.limit for v in values):
            self.broken = True
            fut.set_exception(MessageSizeTooLargeError())
        else:
            self.staged += values
            fut.set_result(None)
        return fut

    async def send_offsets_to_transaction(self, offsets: dict[Any, int], group: str) -> None:
        assert self.in_txn
        self.staged_offsets.update(offsets)

    async def commit_transaction(self) -> None:
        assert self.in_txn
        if self.fence_on_commit:
            raise ProducerFenced()
        self.cluster.log += self.staged
        self.cluster.offsets.update(self.staged_offsets)
        self.cluster.transactions += 1
        self._end()

    async def abort_transaction(self) -> None:
        self.aborts += 1
        self._end()

    def _end(self) -> None:
        self.in_txn, self.staged, self.staged_offsets = False, [], {}

    async def stop(self) -> None:
        self.stopped = True


class Lease:
    def __init__(self, held: bool = True) -> None:
        self.value = held
        self.visible: list[dict[TopicPartition, int]] = []

    async def held(self) -> bool:
        return self.value

    async def offsets_visible(self, offsets: dict[TopicPartition, int]) -> None:
        self.visible.append(offsets)


@dataclass
class Rig:
    sink: ExactlyOnceWriter
    source: asyncio.Queue[asyncio.Future[Completed] | None]
    tracker: OffsetTracker
    cluster: Cluster
    made: list[TxnProducer]
    lease: Lease


async def rig(
    lease: Lease | None = None,
    fence_on_commit: bool = False,
    producer: type[TxnProducer] = TxnProducer,
) -> Rig:
    cluster, made, tracker = Cluster(), list[TxnProducer](), OffsetTracker()
    lease = lease or Lease()

    async def factory(k: KafkaConfig) -> tuple[Any, bool]:
        made.append(producer(cluster, fence_on_commit))
        return made[-1], True

    source: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue()
    committer = Committer(tracker, FakeGroup(), transactional=True)
    kafka = KafkaConfig(retry_backoff_ms=1, group_instance_id="w1")
    parts = WriterParts(source, kafka, {"m": ModelInfo("m", "1")}, tracker, committer)
    sink = ExactlyOnceWriter(
        parts,
        lease,  # type: ignore[arg-type]
        max_batches=4,
        producer_factory=factory,
    )
    await sink.start()
    return Rig(sink, source, tracker, cluster, made, lease)


def batch(r: Rig, offsets: list[int], big: set[int] = frozenset()) -> asyncio.Future[Completed]:  # type: ignore[assignment]
    """A completed batch answering ``offsets`` (each tracked first, in order)."""
    answers = []
    for offset in offsets:
        epoch = r.tracker.track(A, offset)
        job = Job(A, offset, b"k", arrived=time.monotonic(), deadline=None, epoch=epoch)
        message = "x" * (5000 if offset in big else 10)
        answers.append(Answer(job, error=ErrorInfo("deadline_exceeded", message)))
    fut: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
    fut.set_result(Completed(seq=offsets[0], answers=tuple(answers), engine_rows=0))
    return fut


def answered(cluster: Cluster) -> list[int]:
    return [decode_result(v).source.offset for v in cluster.log]


async def test_answers_and_their_offsets_commit_together_per_group_of_batches() -> None:
    r = await rig()
    for offsets in ([0, 1], [2, 3], [4, 5]):
        r.source.put_nowait(batch(r, offsets))
    r.source.put_nowait(None)
    await asyncio.wait_for(r.sink.run(), 5)
    assert answered(r.cluster) == [0, 1, 2, 3, 4, 5]
    assert r.cluster.transactions == 1  # three completed batches, one transaction
    assert list(r.cluster.offsets.values()) == [6]
    assert r.tracker.in_flight() == 0 and r.tracker.committed(A) == 6


async def test_a_gap_keeps_the_transaction_open_until_it_fills() -> None:
    """Offsets 2 and 3 are answered before 0 and 1 (batches complete out of offset
    order): committing them with offset 0 would have a new owner answer them
    again, so nothing commits until 0 and 1 are in the transaction too."""
    r = await rig()
    early = batch(r, [0, 1])  # tracked first, answered last
    late_fut = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(r.sink.run())
    try:
        r.source.put_nowait(batch(r, [2, 3]))
        await asyncio.sleep(0.05)
        assert r.cluster.transactions == 0 and r.made[0].in_txn and r.made[0].staged
        r.source.put_nowait(late_fut)
        late_fut.set_result(early.result())
        r.source.put_nowait(None)
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
    assert sorted(answered(r.cluster)) == [0, 1, 2, 3] and r.cluster.transactions == 1
    assert list(r.cluster.offsets.values()) == [4]


async def test_a_record_refused_for_good_aborts_and_everything_is_answered_once() -> None:
    """The broker refuses one result for good (too large), and with it the record
    batch it was in, which also breaks the producer's sequence: the transaction
    is aborted, the producer replaced, and the records sent again one per record
    batch; the one refused on its own is then replaced by its small too_large
    fallback (a second abort and renewal), its neighbours are answered as they were."""
    r = await rig()
    r.cluster.limit = 1000
    r.source.put_nowait(batch(r, [0, 1, 2, 3], big={1}))
    r.source.put_nowait(None)
    await asyncio.wait_for(r.sink.run(), 5)
    assert answered(r.cluster) == [0, 1, 2, 3]  # once each: the aborted attempt left nothing
    codes = [decode_result(v).error.code for v in r.cluster.log]  # type: ignore[union-attr]
    assert codes == ["deadline_exceeded", "too_large", "deadline_exceeded", "deadline_exceeded"]
    assert len(r.made) == 3 and r.made[0].stopped and r.made[1].stopped  # new epochs
    assert list(r.cluster.offsets.values()) == [4]


async def test_nothing_commits_while_group_membership_is_unconfirmed() -> None:
    """A member the coordinator does not confirm (expelled while paused, say) may
    have lost its partitions to another: its transaction is aborted, and sent
    again once membership is confirmed."""
    lease = Lease(held=False)
    r = await rig(lease)
    task = asyncio.create_task(r.sink.run())
    try:
        r.source.put_nowait(batch(r, [0, 1]))
        await asyncio.sleep(0.05)
        assert r.cluster.transactions == 0 and r.made[-1].aborts >= 1
        lease.value = True
        r.source.put_nowait(None)
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
    assert answered(r.cluster) == [0, 1] and list(r.cluster.offsets.values()) == [2]


class SlowAbort(TxnProducer):
    """Its abort waits until ``release`` is set (a broker slow to answer)."""

    release = asyncio.Event()

    async def abort_transaction(self) -> None:
        await self.release.wait()
        await super().abort_transaction()


async def test_delivery_is_not_ready_from_the_moment_a_transaction_fails() -> None:
    """Readiness drops as soon as a transaction is known to fail, not once its
    abort (which can take up to the request timeout) has returned."""
    SlowAbort.release = asyncio.Event()
    lease = Lease(held=False)
    r = await rig(lease, producer=SlowAbort)
    metrics.set_condition("delivery", True)
    task = asyncio.create_task(r.sink.run())
    try:
        r.source.put_nowait(batch(r, [0, 1]))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not metrics.conditions()["delivery"]:
                break
        assert r.made[0].aborts == 0, "the abort is still waiting for the broker"
        assert metrics.conditions()["delivery"] is False
        lease.value = True
        SlowAbort.release.set()
        r.source.put_nowait(None)
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
    assert answered(r.cluster) == [0, 1]
    assert metrics.conditions()["delivery"] is True  # a transaction committed again


async def test_a_revocation_aborts_an_open_transaction_holding_its_partitions() -> None:
    r = await rig()
    r.tracker.track(A, 0)  # read, never answered: the transaction stays open
    task = asyncio.create_task(r.sink.run())
    try:
        r.source.put_nowait(batch(r, [1, 2]))
        await asyncio.sleep(0.05)
        assert r.made[0].in_txn and r.cluster.transactions == 0
        await r.sink.fence({A})
        r.tracker.forget({A})  # what Committer.settle_revoked does right after
        assert not r.made[0].in_txn and r.made[0].aborts == 1
        r.source.put_nowait(None)
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
    assert r.cluster.log == [] and r.cluster.offsets == {}  # the new owner answers them
    assert r.lease.visible == [{}]


async def test_a_fenced_producer_stops_the_sink() -> None:
    """ProducerFenced: a restarted instance of this member took its transactional
    id. This process is the zombie and must stop, uncommitted."""
    r = await rig(fence_on_commit=True)
    r.source.put_nowait(batch(r, [0]))
    with pytest.raises(TransactionFenced, match="w1"):
        await asyncio.wait_for(r.sink.run(), 5)
    assert r.cluster.log == []
