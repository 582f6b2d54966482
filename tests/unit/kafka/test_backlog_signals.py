"""``infer_backlog_records`` and ``infer_seconds_to_drain`` as the worker
publishes them: the real lag monitor (``report_partitions``), the real intake
counting a shared topic's records, the real CPU stage timing its batches; only
the Kafka consumer they read offsets from is a stand-in (the smallest one: an
assignment and the high watermarks its last fetch saw)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from aiokafka.structs import TopicPartition as KafkaTP
from prometheus_client import REGISTRY

from tests.models import cpu_stage, jobs_for
from worker.config import LimitsConfig, ModelConfig
from worker.config.models import Routing
from worker.contract import ModelRef, Request, Tensor, encode_request
from worker.flow.drain import Shares
from worker.flow.messages import Batch, Completed, Job, TopicPartition
from worker.kafka.intake import JobFactory
from worker.kafka.monitors import report_partitions
from worker.obs import backlog


class Lags:
    """What ``report_partitions`` reads of the consumer: its client's assignment
    and each partition's high watermark."""

    def __init__(self, high: dict[TopicPartition, int]) -> None:
        self.high = high
        self.client = self
        self.committed_at_assignment: dict[TopicPartition, int] = {}

    def assignment(self) -> set[KafkaTP]:
        return {KafkaTP(tp.topic, tp.partition) for tp in self.high}

    def highwater(self, ktp: KafkaTP) -> int | None:
        return self.high.get(TopicPartition(ktp.topic, ktp.partition))


def gauge(name: str, model: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": model})


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    backlog.withdraw_all()
    yield
    backlog.withdraw_all()


async def answer_one_batch(rows: int) -> None:
    """``rows`` digit images through the real CPU stage's run loop, as the
    worker runs it: the stage times the batch into the model's busy rate."""
    batches: asyncio.Queue[Batch[Job] | None] = asyncio.Queue()
    out: asyncio.Queue[asyncio.Future[Completed] | None] = asyncio.Queue()
    stage = cpu_stage(ModelConfig(), batches_in=batches, completed_out=out)
    image = Tensor.from_numpy(np.zeros((8, 8, 1), np.uint8))
    jobs = jobs_for(stage.binding.inputs, [{"image": image}] * rows)
    try:
        batches.put_nowait(Batch(jobs, time.monotonic(), "full"))
        batches.put_nowait(None)
        await stage.run()
        fut = await out.get()
        assert fut is not None and len((await fut).answers) == rows
        await asyncio.sleep(0)  # its done-callbacks (the timing) run
    finally:
        stage.close()


class Monitor:
    """The real monitor as a task, polling every 10 ms."""

    def __init__(self, source: Lags, committed: dict[TopicPartition, int], routing: Routing,
                 shares: Shares) -> None:  # fmt: skip
        self.task = asyncio.create_task(
            report_partitions(source, committed.get, {}, routing, shares, interval=0.01)  # type: ignore[arg-type]
        )

    async def until(self, what: Callable[[], bool]) -> None:
        for _ in range(300):
            if what():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the monitor never published what was awaited")

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_a_model_s_backlog_drains_at_its_measured_rate_and_the_other_reads_0() -> None:
    a0, a1, b0 = TopicPartition("a", 0), TopicPartition("a", 1), TopicPartition("b", 0)
    source = Lags({a0: 120, a1: 80, b0: 30})
    committed = {a0: 20, a1: 80, b0: 30}  # model a: 100 + 0 behind; model b: none
    routing = Routing({"a": "digits", "b": "other"}, frozenset(), ("digits", "other"))
    monitor = Monitor(source, committed, routing, Shares())
    try:
        # No batch answered yet: a backlog in records, no seconds (no rate to divide by).
        await monitor.until(lambda: gauge("infer_backlog_records", "digits") == 100)
        assert gauge("infer_seconds_to_drain", "digits") is None
        assert gauge("infer_backlog_records", "other") == 0
        assert gauge("infer_seconds_to_drain", "other") == 0  # no backlog: 0, with no rate
        await answer_one_batch(32)
        await monitor.until(lambda: gauge("infer_seconds_to_drain", "digits") is not None)
        rate = backlog.rate_of("digits").rate
        assert rate is not None and rate > 0
        assert gauge("infer_backlog_records", "digits") == 100
        assert gauge("infer_seconds_to_drain", "digits") == pytest.approx(100 / rate)
        # Drained: both read 0; model b's partition moved away: its series go.
        committed[a0] = 120
        del source.high[b0]
        await monitor.until(lambda: gauge("infer_backlog_records", "other") is None)
        assert gauge("infer_seconds_to_drain", "other") is None
        assert gauge("infer_backlog_records", "digits") == 0
        assert gauge("infer_seconds_to_drain", "digits") == 0
    finally:
        await monitor.stop()
    # The monitor ended (the worker stopped): no series left behind.
    assert gauge("infer_backlog_records", "digits") is None
    assert gauge("infer_seconds_to_drain", "digits") is None


async def test_a_shared_topic_s_backlog_splits_as_the_intake_routed_its_records() -> None:
    shared = TopicPartition("t", 0)
    routing = Routing({"t": "digits"}, frozenset({"t"}), ("digits", "twin"))
    shares = Shares()
    inputs = cpu_stage(ModelConfig()).binding.inputs
    intake = JobFactory(inputs, LimitsConfig(), model="digits", routing=routing,
                        others={"twin": (inputs, LimitsConfig())}, shares=shares)  # fmt: skip
    image = Tensor.from_numpy(np.zeros((8, 8, 1), np.uint8))
    for i, named in enumerate([None, "twin", "twin", "twin"]):
        request = Request(v=1, id=f"r{i}", inputs={"image": image},
                          model=ModelRef(named) if named else None)  # fmt: skip
        job = intake("t", 0, i, None, encode_request(request))
        assert job.failure is None and job.model == (named or "digits")
    monitor = Monitor(Lags({shared: 100}), {shared: 0}, routing, shares)
    try:
        await monitor.until(lambda: gauge("infer_backlog_records", "twin") is not None)
        assert gauge("infer_backlog_records", "digits") == 25
        assert gauge("infer_backlog_records", "twin") == 75
    finally:
        await monitor.stop()
