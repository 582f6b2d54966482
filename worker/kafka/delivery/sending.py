"""Records handed to the producer: one record batch per output partition, as
``send()`` would place them (the default partitioner: murmur2 of the key), or
on a record's own partition where it names one (a state changelog record)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from worker.kafka.delivery.outgoing import OutRecord
from worker.kafka.delivery.partitioning import partitions_for

Sent = list[tuple[OutRecord, "asyncio.Future[object]"]]


async def send_grouped(producer: AIOKafkaProducer, outs: list[OutRecord]) -> Sent:
    """Hand a completed batch's records to the producer as one record batch
    per output partition, instead of one ``send()`` per record: the per-record
    cost of the producer's send path was the largest single share of the
    writer's cost. Partitions are chosen exactly as ``send()`` would (the
    default partitioner: murmur2 of the key; ``partitioning`` hashes a batch's
    keys at once), and each record's future is its batch's, so acknowledgement
    and redelivery work per record as before."""
    by_topic: dict[str, list[OutRecord]] = {}
    for out in outs:
        by_topic.setdefault(out.topic, []).append(out)
    by_partition: dict[tuple[str, int], list[OutRecord]] = {}
    for topic, records in by_topic.items():
        try:
            parts = sorted(await producer.partitions_for(topic))
        except KafkaError:
            return [(o, await send_one(producer, o)) for o in outs]  # send() reports it
        # The keyed records' partitions, hashed together, taken in their order.
        chosen = iter(partitions_for([o.key for o in records if o.partition is None], parts))
        for out in records:  # in order: a partition's records keep theirs
            partition = out.partition if out.partition is not None else next(chosen)
            by_partition.setdefault((topic, partition), []).append(out)
    sent: Sent = []
    for (topic, partition), group in by_partition.items():
        batch, members = producer.create_batch(), []
        for out in group:
            if batch.append(key=out.key, value=out.value, timestamp=None, headers=out.headers):
                members.append(out)
                continue
            if members:  # full: send it, start the next with this record
                sent += await _submit(producer, batch, topic, partition, members)
                batch, members = producer.create_batch(), []
                if batch.append(key=out.key, value=out.value, timestamp=None, headers=out.headers):
                    members.append(out)
                    continue
            sent.append((out, await send_one(producer, out)))  # larger than a batch on its own
        if members:
            sent += await _submit(producer, batch, topic, partition, members)
    return sent


async def _submit(
    producer: AIOKafkaProducer, batch: Any, topic: str, partition: int, members: list[OutRecord]
) -> Sent:
    batch.close()
    try:
        fut: asyncio.Future[object] = await producer.send_batch(batch, topic, partition=partition)
    except KafkaError as exc:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(exc)
    return [(out, fut) for out in members]


async def send_one(producer: AIOKafkaProducer, out: OutRecord) -> asyncio.Future[object]:
    """Hand one record to the producer; a failure to even enqueue it becomes a
    failed future, handled like a failed ack."""
    try:
        fut: asyncio.Future[object] = await producer.send(
            out.topic,
            value=out.value,
            key=out.key,
            headers=out.headers,
            partition=out.partition,
        )
    except KafkaError as exc:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(exc)
    return fut
