"""The most urgent lane's records go through a producer of their own (the
at-least-once writer's ``Producing(lane_producer=True)``), against a real broker:
aiokafka keeps one produce request in flight per connection, and an urgent
result otherwise waited behind the bulk lane's (BENCHMARKS.md, priority lanes).

The producers are real; each one's record batches are wrapped only to note
which keys it was handed. What reaches the broker is read back."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from worker.config.kafka import KafkaConfig, LaneConfig
from worker.flow.messages import Job, TopicPartition
from worker.kafka.clients import start_producer
from worker.kafka.delivery.outgoing import OutRecord
from worker.kafka.delivery.producing import Producing
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import Collector

pytestmark = pytest.mark.integration

N = 40  # records, alternating between the lanes


class Noted:
    """Makes real producers and notes what each is handed (in creation order)."""

    def __init__(self) -> None:
        self.made: list[AIOKafkaProducer] = []
        self.handed: dict[int, list[bytes]] = {}  # by id of the producer: keys, in order
        self.stopped: set[int] = set()

    async def __call__(self, k: KafkaConfig) -> tuple[AIOKafkaProducer, bool]:
        producer, idempotent = await start_producer(k)
        seen = self.handed[id(producer)] = []
        create_batch, stop = producer.create_batch, producer.stop

        def noted_create_batch() -> Any:
            batch = create_batch()
            append = batch.append

            def noted_append(*, key: Any, value: Any, timestamp: Any, headers: Any = None) -> Any:
                meta = append(key=key, value=value, timestamp=timestamp, headers=headers)
                if meta is not None:  # taken into the batch
                    seen.append(key)
                return meta

            batch.append = noted_append
            return batch

        async def noted_stop() -> None:
            self.stopped.add(id(producer))
            await stop()

        producer.create_batch = noted_create_batch  # type: ignore[method-assign]
        producer.stop = noted_stop  # type: ignore[method-assign]
        self.made.append(producer)
        return producer, idempotent


def _config(broker: Broker, urgent: str, bulk: str, out: str) -> KafkaConfig:
    return KafkaConfig(
        bootstrap_servers=broker.bootstrap,
        input_topics=(urgent, bulk),
        output_topic=out,
        lanes=(LaneConfig((urgent,)), LaneConfig((bulk,), priority=1)),
    )


def _outs(urgent: str, bulk: str, out: str) -> list[OutRecord]:
    """Results of N requests, alternating lanes, each lane's in request order."""
    outs = []
    for i in range(N):
        topic, lane = (urgent, b"u") if i % 2 == 0 else (bulk, b"b")
        job = Job(TopicPartition(topic, 0), i, None, 0.0, None)
        key = lane + str(i).encode()
        outs.append(OutRecord(job, out, key, b"%d" % i, [], "ok", i))
    return outs


async def _topics(broker: Broker, names: dict[str, str], out_parts: int) -> tuple[str, str, str]:
    """(urgent, bulk, output) topics, created."""
    urgent, bulk = names["requests"] + ".urgent", names["requests"] + ".bulk"
    out = names["results"]
    await create_topics(broker.bootstrap, {urgent: 1, bulk: 1, out: out_parts})
    return urgent, bulk, out


async def test_the_urgent_lane_has_a_producer_of_its_own(
    broker: Broker, names: dict[str, str]
) -> None:
    urgent, bulk, out = await _topics(broker, names, 2)
    factory = Noted()
    producing = Producing(_config(broker, urgent, bulk, out), factory, lane_producer=True)
    await producing.start()
    try:
        assert len(factory.made) == 2 and producing.urgent is factory.made[1]
        sent = await producing.send_grouped(_outs(urgent, bulk, out))
        assert await producing.failures(sent, caught=(Exception,)) == {}
        main_keys = factory.handed[id(producing.producer)]
        urgent_keys = factory.handed[id(producing.urgent)]
        # Each lane through one producer: the urgent lane's through its own.
        assert sorted(urgent_keys) == sorted(b"u%d" % i for i in range(0, N, 2))
        assert sorted(main_keys) == sorted(b"b%d" % i for i in range(1, N, 2))
        old = set(map(id, factory.made))
        await producing.replace("test")
        # Both renewed, both old ones closed.
        assert len(factory.made) == 4 and factory.stopped == old
        assert {id(producing.producer), id(producing.urgent)} == set(map(id, factory.made[2:]))
    finally:
        await producing.close()
    c = Collector(broker.bootstrap, [out])
    await c.start()
    try:
        assert await c.collect(lambda c: c.count() >= N, 30.0)
        await c.collect(lambda c: False, 0.3)
    finally:
        await c.stop()
    got = c.records[out]
    assert sorted(r.record_key or b"" for r in got) == sorted(
        o.key or b"" for o in _outs(urgent, bulk, out)
    )
    # Within an output partition, each lane's results in request order.
    for partition in {r.partition for r in got}:
        for lane in (b"u", b"b"):
            mine = [r for r in got if (r.record_key or b"").startswith(lane)]
            seq = [int(r.value) for r in mine if r.partition == partition]
            assert seq == sorted(seq)


async def test_one_lane_or_the_exactly_once_writer_keep_one_producer(
    broker: Broker, names: dict[str, str]
) -> None:
    urgent, bulk, out = await _topics(broker, names, 1)
    one_lane = KafkaConfig(
        bootstrap_servers=broker.bootstrap, input_topics=(urgent, bulk), output_topic=out
    )
    # Lanes without lane_producer: how the exactly-once writer makes it.
    for k, own in ((_config(broker, urgent, bulk, out), False), (one_lane, True)):
        factory = Noted()
        producing = Producing(k, factory, lane_producer=own)
        await producing.start()
        try:
            sent = await producing.send_grouped(_outs(urgent, bulk, out))
            assert await producing.failures(sent, caught=(Exception,)) == {}
            assert len(factory.made) == 1 and producing.urgent is None
            assert len(factory.handed[id(producing.producer)]) == N
        finally:
            await producing.close()


async def test_either_producer_idempotent_renews_both(
    broker: Broker, names: dict[str, str]
) -> None:
    """``enable_idempotence = "auto"`` may end differently for the two starts; a
    refusal for good must then still renew them (a broken sequence otherwise
    stays broken), so ``idempotent`` is true if either producer is."""
    urgent, bulk, out = await _topics(broker, names, 1)
    noted = Noted()

    async def second_only(k: KafkaConfig) -> tuple[AIOKafkaProducer, bool]:
        producer, _ = await noted(k)
        return producer, len(noted.made) % 2 == 0  # the urgent lane's, made second

    producing = Producing(_config(broker, urgent, bulk, out), second_only, lane_producer=True)
    await producing.start()
    try:
        assert producing.idempotent
        await producing.replace("test")
        assert producing.idempotent and len(noted.made) == 4
    finally:
        await producing.close()
