"""The path around the worker, without the worker: what the GPU session's paced
p99 holds that the worker's own stages do not (issue 55).

A bench-like sender produces ``--bytes`` records open-loop at ``--rate`` over 8
partitions (worker.ops.topics.produce_all, as ``bench`` sends); ``--echoes``
consumers in one group each read their partitions and answer every record at
once with a 4 KB record to a results topic (what a worker with a zero-time model
would do, aiokafka on both sides); a collector (worker.ops.topics.Collector, as
``bench`` collects) times each answer from its send. Prints p50/p99 of the
whole trip and of the first leg (send to the echo's read). One-off probe, kept
beside the results it explains:

    .venv/bin/python benchmarks/results/2026-11-28-gpu/echo_probe.py --broker embedded --rate 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.topics import Collector, produce_all

PARTS = 8


async def echo(
    bootstrap: str, first_read: dict[bytes, float], stop: asyncio.Event, ready: asyncio.Event
) -> None:
    # fetch_max_wait_ms as bench runs the worker: Tansu holds a fetch that long.
    consumer = AIOKafkaConsumer(
        "probe.requests", bootstrap_servers=bootstrap, group_id="probe-echo",
        auto_offset_reset="earliest", enable_auto_commit=True, fetch_max_wait_ms=10,
    )  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2, acks="all")
    await consumer.start()
    await producer.start()
    answer = bytes(4096)
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=100)
            if consumer.assignment():
                ready.set()
            for tp, records in batches.items():
                for r in records:
                    assert r.key is not None
                    first_read[r.key] = time.monotonic()
                    await producer.send("probe.results", answer, key=r.key, partition=tp.partition)
    finally:
        await producer.stop()
        await consumer.stop()


async def main(args: argparse.Namespace) -> dict[str, object]:
    broker: object
    if args.broker == "embedded":
        broker = EmbeddedBroker().start()
    else:
        from devkit.apache_kafka import KafkaCluster

        broker = KafkaCluster().start()
    try:
        bootstrap = broker.bootstrap  # type: ignore[attr-defined]
        await create_topics(bootstrap, {"probe.requests": PARTS, "probe.results": PARTS})
        n = int(args.rate * args.seconds)
        payload = bytes(np.random.default_rng(0).integers(0, 256, args.bytes, dtype=np.uint8))
        records = [(f"r{i}".encode(), payload) for i in range(n)]
        collector = Collector(bootstrap, ["probe.results"])
        await collector.start()
        first_read: dict[bytes, float] = {}
        stop = asyncio.Event()
        ready = [asyncio.Event() for _ in range(args.echoes)]
        echoes = [asyncio.create_task(echo(bootstrap, first_read, stop, r)) for r in ready]
        for r in ready:  # the group formed before the first send
            await r.wait()
        await asyncio.sleep(1)
        t0 = time.monotonic()
        collecting = asyncio.create_task(  # as bench's open loop: reading while sending
            collector.collect(lambda c: len(c.records["probe.results"]) >= n, 60 + args.seconds)
        )
        produced = await produce_all(
            bootstrap, "probe.requests", records, partition_of=lambda i: i % PARTS, rate=args.rate
        )
        offered = n / (produced[-1].sent_at - produced[0].sent_at)
        await collecting
        stop.set()
        await asyncio.gather(*echoes)
        await collector.stop()
        sent = {p.key: p.sent_at for p in produced}
        got = {r.record_key: r.received_at for r in collector.records["probe.results"]}
        trip = np.array([got[k] - sent[k] for k in sent if k in got]) * 1000
        leg1 = np.array([first_read[k] - sent[k] for k in sent if k in first_read]) * 1000
        return {
            "broker": args.broker, "rate": args.rate, "offered": round(offered, 1),
            "bytes": args.bytes, "echoes": args.echoes, "answered": len(trip),
            "wall_s": round(time.monotonic() - t0, 1),
            "trip_p50_ms": round(float(np.percentile(trip, 50)), 1),
            "trip_p99_ms": round(float(np.percentile(trip, 99)), 1),
            "leg1_p50_ms": round(float(np.percentile(leg1, 50)), 1),
            "leg1_p99_ms": round(float(np.percentile(leg1, 99)), 1),
        }  # fmt: skip
    finally:
        broker.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--broker", choices=("embedded", "kafka"), default="embedded")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--bytes", type=int, default=19_601)
    p.add_argument("--echoes", type=int, default=1)
    print(json.dumps(asyncio.run(main(p.parse_args()))), flush=True)
