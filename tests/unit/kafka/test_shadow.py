"""A shadow deployment (``kafka.shadow``): the setting, no DLQ records written
(a DLQ-bound record is logged and its offset still settles, under both
guarantees), and no crash guard. The writers run for real against the stand-in
producers of ``test_stages`` and ``test_transactions``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

import pytest
from structlog.testing import capture_logs

from tests.models import model_inputs
from worker.app.plan import RunPlan
from worker.app.stages import Stages, crash_guard
from worker.config import KafkaConfig, LimitsConfig, load_settings
from worker.contract import ErrorInfo, ModelInfo, decode_result
from worker.flow.errors import ConfigError
from worker.flow.messages import Answer, Completed, Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.commit import Committer
from worker.kafka.delivery.at_least_once import AtLeastOnceWriter
from worker.kafka.delivery.exactly_once import ExactlyOnceWriter
from worker.kafka.delivery.writer import WriterParts
from worker.kafka.intake import JobFactory

from .test_stages import FakeGroup, FakeProducer, completed
from .test_transactions import Cluster, Lease, TxnProducer

A = TopicPartition("in", 0)


def test_shadow_is_off_by_default_and_set_from_the_file_or_the_environment(
    tmp_path: Path,
) -> None:
    assert load_settings(env={}).kafka.shadow is False
    assert load_settings(env={"INFER_WORKER_KAFKA__SHADOW": "true"}).kafka.shadow is True
    toml = tmp_path / "w.toml"
    toml.write_text('[kafka]\nshadow = true\ngroup_id = "candidate"\n')
    assert load_settings(toml, env={}).kafka.shadow is True
    with pytest.raises(ConfigError, match=r"kafka\.shadow"):
        load_settings(env={"INFER_WORKER_KAFKA__SHADOW": "sometimes"})


def undecodable(tracker: OffsetTracker, offset: int) -> Answer:
    """An answer to a record that is not msgpack: bound for the DLQ."""
    epoch = tracker.track(A, offset)
    job = JobFactory(model_inputs(), LimitsConfig())(
        A.topic, A.partition, offset, b"k", b"\xc1 not msgpack", epoch=epoch
    )
    assert job.failure is not None
    return Answer(job)


def rejected(tracker: OffsetTracker, offset: int) -> Answer:
    """An answer that is a result (an error result), whatever the deployment."""
    epoch = tracker.track(A, offset)
    job = Job(A, offset, b"k", arrived=time.monotonic(), deadline=None, epoch=epoch)
    return Answer(job, error=ErrorInfo("deadline_exceeded", "late"))


async def at_least_once(shadow: bool) -> tuple[FakeProducer, OffsetTracker, list[Any]]:
    tracker, producer = OffsetTracker(), FakeProducer()
    source: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue()
    parts = WriterParts(
        source, KafkaConfig(retry_backoff_ms=1, shadow=shadow), {"m": ModelInfo("m", "1")}, tracker,
        Committer(tracker, FakeGroup()),
    )  # fmt: skip
    writer = AtLeastOnceWriter(parts, max_pending_acks=2)
    writer._producing.producer = producer  # type: ignore[assignment]
    source.put_nowait(completed(rejected(tracker, 0), undecodable(tracker, 1)))
    source.put_nowait(completed(undecodable(tracker, 2)))  # a batch of DLQ records only
    source.put_nowait(None)
    with capture_logs() as logs:
        await asyncio.wait_for(writer.run(), 5)
    return producer, tracker, logs


async def test_a_shadow_writes_no_dlq_record_but_logs_it_and_settles_its_offset() -> None:
    producer, tracker, logs = await at_least_once(shadow=True)
    assert [topic for topic, _, _ in producer.acked] == ["infer.results"]
    assert decode_result(producer.acked[0][2] or b"").source.offset == 0
    # Every offset settled: the DLQ-bound ones count as answered.
    assert tracker.in_flight(A) == 0 and tracker.committable() == {A: 3}
    withheld = [e for e in logs if e.get("sent_to") == "none (shadow)"]
    assert [e["offset"] for e in withheld] == [1, 2]
    assert {e["code"] for e in withheld} == {"undecodable"}


async def test_without_shadow_the_same_records_go_to_the_dlq() -> None:
    producer, tracker, logs = await at_least_once(shadow=False)
    assert [topic for topic, _, _ in producer.acked] == [
        "infer.results", "infer.dlq", "infer.dlq",
    ]  # fmt: skip
    assert tracker.committable() == {A: 3}
    assert [e["offset"] for e in logs if e.get("sent_to") == "dlq"] == [1, 2]


async def test_an_exactly_once_shadow_commits_a_dlq_bound_offset_with_the_next_results() -> None:
    tracker, cluster = OffsetTracker(), Cluster()

    async def factory(k: KafkaConfig) -> tuple[Any, bool]:
        return TxnProducer(cluster), True

    source: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue()
    kafka = KafkaConfig(retry_backoff_ms=1, group_instance_id="w1", shadow=True)
    committer = Committer(tracker, FakeGroup(), transactional=True)
    parts = WriterParts(source, kafka, {"m": ModelInfo("m", "1")}, tracker, committer)
    writer = ExactlyOnceWriter(parts, Lease(), max_batches=4, producer_factory=factory)  # type: ignore[arg-type]
    await writer.start()
    source.put_nowait(completed(undecodable(tracker, 0), rejected(tracker, 1)))
    source.put_nowait(None)
    await asyncio.wait_for(writer.run(), 5)
    assert [decode_result(v).source.offset for v in cluster.log] == [1]  # no DLQ record
    assert list(cluster.offsets.values()) == [2]  # offset 0 committed with offset 1's result


def test_a_shadow_runs_without_the_crash_guard_and_says_why() -> None:
    s = load_settings(env={"INFER_WORKER_KAFKA__SHADOW": "true"})
    with capture_logs() as logs:
        # The guard topic exists: only the shadow setting turns the guard off
        # (the stages are never touched on that path).
        guard = crash_guard(s, RunPlan.of(s), cast(Stages, None), {s.kafka.crash_guard_topic})
    assert guard is None
    (line,) = [e for e in logs if e["event"] == "crash_loop_protection_off"]
    assert line["log_level"] == "info" and "kafka.shadow" in line["reason"]
