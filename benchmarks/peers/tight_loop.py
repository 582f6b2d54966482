"""Peer: the tight aiokafka loop a competent engineer writes in an afternoon.

    getmany -> decode -> one batched ONNX Runtime run -> produce all -> await acks
    -> commit -> repeat

Same model, same preprocessing code (the worker's NumPy reference), same wire
contract for requests and results (error handling reduced to what the benchmark
payloads need: every record here is valid). No pipelining between stages, no
deadline batching, no backpressure, no DLQ: that is what it saves, and what it
gives up. Settings come from ``INFER_WORKER_*`` like the worker's, so the
benchmark starts it the same way. Benchmark code, not shipped.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from benchmarks.peers.common import Model


async def main() -> None:
    model = Model()
    s = model.settings
    k = s.kafka
    consumer = AIOKafkaConsumer(
        *k.input_topics,
        bootstrap_servers=k.bootstrap_servers,
        group_id=k.group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=k.fetch_max_wait_ms,
        max_partition_fetch_bytes=k.max_partition_fetch_bytes,
    )
    producer = AIOKafkaProducer(bootstrap_servers=k.bootstrap_servers, acks="all", linger_ms=2)
    await consumer.start()
    await producer.start()
    try:
        while True:
            fetched = await consumer.getmany(timeout_ms=100, max_records=s.batching.max_batch_size)
            records = [r for batch in fetched.values() for r in batch]
            if not records:
                continue
            answers = model.answer(
                [r.value for r in records], [(r.topic, r.partition, r.offset) for r in records]
            )
            acks = [
                await producer.send(
                    k.output_topic, value, key=record.key, headers=[("id", rid.encode())]
                )
                for record, (rid, value) in zip(records, answers, strict=True)
            ]
            await asyncio.gather(*acks)
            offsets = {}
            for tp, batch_records in fetched.items():
                offsets[TopicPartition(tp.topic, tp.partition)] = batch_records[-1].offset + 1
            await consumer.commit(offsets)
    finally:
        await consumer.stop()
        await producer.stop()


if __name__ == "__main__":
    asyncio.run(main())
