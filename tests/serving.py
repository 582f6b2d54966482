"""Serving a model from Kafka in a test: a real worker process on fresh topics,
requests in, every result back, the DLQ and the commits checked."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from worker.contract import ModelRef, Request, Result, encode_request
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, committed_offsets, produce_all


def wire(rid: str, inputs: Mapping[str, Any], model: ModelRef | None = None) -> bytes:
    return encode_request(Request(v=1, id=rid, inputs=dict(inputs), model=model))


async def serve(
    broker: Broker,
    names: dict[str, str],
    requests: list[tuple[str, bytes]],
    env: dict[str, str],
    partitions: int = 2,
    metrics: dict[str, float] | None = None,
    backlog: bool = False,
) -> dict[str, Result]:
    """Start a worker with ``env``, send ``requests`` (id, value), and return every
    result by id once all are answered; checks nothing went to the DLQ and that
    the commits cover every request. ``metrics``: filled with the worker's metrics
    once everything is answered. ``backlog``: the requests are all in the topic
    before the worker starts, so its first fetch holds them together (sent to a
    running worker, they arrive as the sender manages, which on a loaded machine
    can be further apart than any batching delay)."""
    await create_topics(
        broker.bootstrap, {names["requests"]: partitions, names["results"]: 1, names["dlq"]: 1}
    )
    records = [(rid.encode(), v) for rid, v in requests]
    produced = await produce_all(broker.bootstrap, names["requests"], records) if backlog else []
    w: WorkerProcess = spawn_worker(
        broker.bootstrap,
        input_topics=[names["requests"]],
        output_topic=names["results"],
        dlq_topic=names["dlq"],
        group_id=names["group"],
        extra_env=env,
    )
    try:
        await asyncio.to_thread(
            w.wait_until,
            lambda m: m.get("infer_assigned_partitions", 0) >= partitions,
            60.0,
            "partition assignment",
        )
        if not backlog:
            produced = await produce_all(broker.bootstrap, names["requests"], records)
        c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
        await c.start()
        try:
            done = await c.collect(lambda c: c.count() >= len(requests), 60.0)
            assert done, f"{c.count()} of {len(requests)} answered\n{w.log_tail()}"
            if metrics is not None:
                metrics.update(w.metrics())
        finally:
            await c.stop()
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert not c.records.get(names["dlq"]), "a request whose envelope decoded went to the DLQ"
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    assert len(results) == len(requests)
    committed = await committed_offsets(
        broker.bootstrap, names["group"], names["requests"], partitions
    )
    assert sum(committed.values()) == len(produced)
    return results
