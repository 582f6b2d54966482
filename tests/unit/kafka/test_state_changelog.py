"""The state changelog without a broker: its records' encoding, and the
at-least-once writer's rule that an offset is done only once its answer and its
state are both acknowledged (a state lost while its request's offset was
committed could not be restored). Restoring from Apache Kafka, across a SIGKILL
and under exactly-once: tests/faults/test_stateful_restore.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from worker.config import KafkaConfig
from worker.contract import ModelInfo, decode_result
from worker.flow.messages import Answer, Completed, Job, StateChange, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.changelog import decode_state, encode_state
from worker.kafka.commit import Committer
from worker.kafka.delivery.at_least_once import AtLeastOnceWriter
from worker.kafka.delivery.writer import WriterParts

from .test_stages import FakeBatch, FakeGroup, FakeProducer

A = TopicPartition("in", 3)


def test_a_state_round_trips_and_an_ended_sequence_is_a_tombstone() -> None:
    job = Job(A, 7, b"stream-1", 0.0, None)
    state = {"h": np.arange(6, dtype=np.float32).reshape(2, 3)}
    back = decode_state(encode_state(job, StateChange(state)) or b"")
    assert set(back) == {"h"} and np.array_equal(back["h"], state["h"])
    assert back["h"].dtype == np.float32
    assert encode_state(job, StateChange(None)) is None


class HoldingProducer(FakeProducer):
    """Acknowledges results at once and state records only when released."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []
        self.held: list[asyncio.Future[object]] = []

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        self.sent.append((topic, partition))
        if topic != "states":
            return await super().send_batch(batch, topic, partition=partition)
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.held.append(fut)
        return fut

    async def partitions_for(self, topic: str) -> set[int]:
        return {0, 1, 2, 3}


async def test_an_offset_is_done_only_once_its_answer_and_its_state_are_acknowledged() -> None:
    tracker = OffsetTracker()
    epoch = tracker.track(A, 0)
    job = Job(A, 0, b"stream-1", time.monotonic(), None, epoch=epoch)
    state = StateChange({"h": np.ones((2, 3), np.float32)})
    answer = Answer(job, outputs={"p": np.zeros(1, np.float32)}, state=state)
    producer = HoldingProducer()
    source: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue()
    committer = Committer(tracker, FakeGroup())
    kafka = KafkaConfig(retry_backoff_ms=1, state_topic="states")
    sink = AtLeastOnceWriter(
        WriterParts(source, kafka, {"m": ModelInfo("m", "1")}, tracker, committer,
                    state_topics={"m": "states"}),
        max_pending_acks=2,
    )
    sink._producing.producer = producer  # type: ignore[assignment]
    fut: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
    fut.set_result(Completed(seq=1, answers=(answer,), engine_rows=1))
    source.put_nowait(fut)
    task = asyncio.create_task(sink.run())
    try:
        for _ in range(100):
            if producer.held:
                break
            await asyncio.sleep(0.01)
        # The state goes to the input's partition number, whatever its key hashes to.
        assert ("states", 3) in producer.sent
        assert decode_result(producer.acked[0][2] or b"").status == "ok"
        await asyncio.sleep(0.05)
        assert tracker.committable() == {}, "done before its state was acknowledged"
        producer.held[0].set_result(None)
        for _ in range(100):
            if tracker.committable() == {A: 1}:
                break
            await asyncio.sleep(0.01)
        assert tracker.committable() == {A: 1}
    finally:
        source.put_nowait(None)
        await asyncio.wait_for(task, 5)
