"""The embedded broker's ingest ceiling against the producer's batch size.

    .venv/bin/python benchmarks/results/2026-11-26-embedded-ceiling-batches.py \
        RECORDS VALUE_BYTES BATCH_BYTES

RECORDS values of VALUE_BYTES (a request-shaped msgpack map around random
bytes) produced to 8 partitions of a fresh Tansu in producer batches of at
most BATCH_BYTES, then read by ``drain_ceiling`` (the benchmarks' bare
consumer). 2026-11-26, 2 cores: 24000 19600 16384 -> 8,942 rec/s;
50000 19600 16384 -> 2,715 rec/s; 50000 19600 1048576 -> 13,459 rec/s.
"""

import asyncio
import os
import sys
import time

import msgpack
from aiokafka import AIOKafkaProducer

from worker.bench.ceiling import drain_ceiling
from worker.ops.broker import EmbeddedBroker, create_topics


async def main(n: int, size: int, batch: int) -> None:
    broker = EmbeddedBroker()
    broker.start()
    try:
        await create_topics(broker.bootstrap, {"req": 8})
        value = msgpack.packb({"v": 1, "id": "x", "inputs": {"image": os.urandom(size)}})
        producer = AIOKafkaProducer(
            bootstrap_servers=broker.bootstrap, linger_ms=2, max_batch_size=batch,
            max_request_size=16 * 1024 * 1024,
        )  # fmt: skip
        await producer.start()
        t0 = time.monotonic()
        try:
            futures = [await producer.send("req", value, partition=i % 8) for i in range(n)]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        print(f"produced {n} in {time.monotonic() - t0:.1f} s")
        drain = await drain_ceiling(broker.bootstrap, "req", n)
        print(f"ceiling {drain.rate:,.0f} rec/s")
    finally:
        broker.stop()


asyncio.run(main(*(int(a) for a in sys.argv[1:4])))
