"""kafka.enable_idempotence: the setting, the producer arguments it gives, and the
result sink's recovery when an idempotent producer's sequence breaks (a stand-in
producer that behaves as aiokafka's does against Kafka; the real one is
exercised in tests/integration/test_producer_safety.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError, OutOfOrderSequenceNumber

from worker.config import KafkaConfig, load_settings
from worker.contract import ErrorInfo, ModelInfo, decode_result
from worker.flow.errors import ConfigError
from worker.flow.messages import Answer, Completed, Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.clients import idempotence, producer_kwargs
from worker.kafka.commit import Committer
from worker.kafka.delivery.at_least_once import AtLeastOnceWriter
from worker.kafka.delivery.writer import WriterParts

from .test_stages import FakeBatch, FakeGroup

A = TopicPartition("in", 0)


def kafka(**env: str) -> KafkaConfig:
    return load_settings(env={f"INFER_WORKER_KAFKA__{k.upper()}": v for k, v in env.items()}).kafka


def test_the_setting_is_auto_by_default_and_takes_true_or_false(tmp_path: Path) -> None:
    assert kafka().enable_idempotence == "auto"
    assert kafka(enable_idempotence="true").enable_idempotence is True
    assert kafka(enable_idempotence="false").enable_idempotence is False
    assert kafka(enable_idempotence="auto").enable_idempotence == "auto"
    toml = tmp_path / "w.toml"
    toml.write_text("[kafka]\nenable_idempotence = false\n")
    assert load_settings(toml, env={}).kafka.enable_idempotence is False
    for bad in ("yes", "1", '"true"'):
        with pytest.raises(ConfigError, match=r"kafka\.enable_idempotence"):
            kafka(enable_idempotence=bad)


async def test_producer_arguments_follow_the_choice_and_the_older_pass_through() -> None:
    assert producer_kwargs(kafka(), True)["enable_idempotence"] is True
    assert producer_kwargs(kafka(), False)["enable_idempotence"] is False
    assert "enable_idempotence" not in producer_kwargs(kafka())  # validation only
    # kafka.producer_options.enable_idempotence passed through before the key
    # existed: it still does, as an explicit choice (no fallback).
    old = kafka(producer_options__enable_idempotence="false")
    assert idempotence(old) is False
    assert producer_kwargs(old, False)["enable_idempotence"] is False
    with pytest.raises(ConfigError, match=r"contradicts kafka\.enable_idempotence"):
        idempotence(kafka(enable_idempotence="true", producer_options__enable_idempotence="false"))
    with pytest.raises(ConfigError, match="expected true/false"):
        idempotence(kafka(producer_options__enable_idempotence='"yes"'))
    for k in (kafka(), old):  # every argument is one aiokafka's producer takes
        AIOKafkaProducer(**producer_kwargs(k, idempotence(k) is not False))


class Partition:
    """One output partition that takes record values up to ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.log: list[bytes] = []


class IdempotentProducer:
    """As aiokafka's idempotent producer behaves against Kafka: once the broker
    refuses a batch for good, every later batch of that partition is refused as
    out of order (aiokafka does not renumber)."""

    def __init__(self, partition: Partition) -> None:
        self.partition = partition
        self.broken = False
        self.stopped = False

    async def partitions_for(self, topic: str) -> set[int]:
        return {0}

    def create_batch(self) -> FakeBatch:
        return FakeBatch()

    async def send_batch(self, batch: FakeBatch, topic: str, *, partition: int) -> Any:
        return self._write([v for _, v in batch.records if v is not None])

    async def send(
        self, topic: str, value: bytes | None = None, key: bytes | None = None, headers: Any = None
    ) -> asyncio.Future[object]:
        return self._write([value or b""])

    def _write(self, values: list[bytes]) -> asyncio.Future[object]:
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.broken:
            fut.set_exception(OutOfOrderSequenceNumber())
        elif any(len(v) > self.partition.limit for v in values):
            self.broken = True
            fut.set_exception(MessageSizeTooLargeError())
        else:
            self.partition.log += values
            fut.set_result(None)
        return fut

    async def stop(self) -> None:
        self.stopped = True


async def test_a_refusal_for_good_renews_the_producer_and_nothing_is_lost() -> None:
    partition = Partition(limit=1000)
    made: list[IdempotentProducer] = []

    async def factory(k: KafkaConfig) -> tuple[Any, bool]:
        made.append(IdempotentProducer(partition))
        return made[-1], True

    tracker = OffsetTracker()
    source: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue()
    committer = Committer(tracker, FakeGroup())
    parts = WriterParts(
        source, KafkaConfig(retry_backoff_ms=1), {"m": ModelInfo("m", "1")}, tracker, committer
    )
    sink = AtLeastOnceWriter(parts, max_pending_acks=2, producer_factory=factory)
    await sink.start()
    assert sink._producing.idempotent  # what decide() is told about this producer
    n, large = 6, 2
    for offset in range(n):
        epoch = tracker.track(A, offset)
        job = Job(A, offset, b"k", arrived=time.monotonic(), deadline=None, epoch=epoch)
        message = "x" * (5000 if offset == large else 10)
        fut: asyncio.Future[Completed] = asyncio.get_running_loop().create_future()
        fut.set_result(
            Completed(
                seq=offset,
                answers=(Answer(job, error=ErrorInfo("deadline_exceeded", message)),),
                engine_rows=0,
            )
        )
        source.put_nowait(fut)
    source.put_nowait(None)
    await asyncio.wait_for(sink.run(), 5)
    results = [decode_result(v) for v in partition.log]
    assert [r.source.offset for r in results] == list(range(n))  # once each, in order
    codes = [r.error.code for r in results if r.error is not None]
    late = "deadline_exceeded"
    assert codes == [late, late, "too_large", late, late, late]
    # Renewed once per refusal for good: twice when the large record was refused
    # beside others first (completed batches are sent together), then alone.
    assert len(made) >= 2 and all(p.stopped for p in made[:-1]) and sink.producer is made[-1]
    assert tracker.committable() == {A: n}
