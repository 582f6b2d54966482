"""End to end: the real embedded broker, real worker processes, real Kafka clients."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import msgpack
import numpy as np
import pytest

from worker.contract import Request, Tensor, encode_request
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, mean_batch_size, spawn_worker
from worker.ops.topics import Collector, committed_offsets, produce_all

pytestmark = pytest.mark.integration


def request_bytes(i: int, size: int = 8, **extra: object) -> bytes:
    rng = np.random.default_rng(i)
    img = rng.integers(0, 256, (size, size, 1), dtype=np.uint8)
    return encode_request(
        Request(
            v=1, id=f"req-{i}", inputs={"image": Tensor.from_numpy(img)}, meta={"i": i}, **extra
        )
    )  # type: ignore[arg-type]


async def start_worker(
    broker: Broker, names: dict[str, str], partitions: int, **env: str
) -> WorkerProcess:
    w = spawn_worker(
        broker.bootstrap,
        input_topics=[names["requests"]],
        output_topic=names["results"],
        dlq_topic=names["dlq"],
        group_id=names["group"],
        extra_env=env,
    )
    await asyncio.to_thread(
        w.wait_until,
        lambda m: m.get("infer_assigned_partitions", 0) >= partitions,
        60.0,
        "partition assignment",
    )
    return w


async def collect(
    broker: Broker,
    topics: list[str],
    n: int,
    timeout: float = 60.0,
    isolation_level: str = "read_uncommitted",
) -> Collector:
    c = Collector(broker.bootstrap, topics, isolation_level=isolation_level)
    await c.start()
    try:
        ok = await c.collect(lambda c: c.count() >= n, timeout)
        assert ok, f"only {c.count()} of {n} records arrived"
        # Anything beyond n would be a duplicate: give it a moment to show up.
        await c.collect(lambda c: False, 0.3)
    finally:
        await c.stop()
    return c


async def test_round_trip_order_batching_and_commits(broker: Broker, names: dict[str, str]) -> None:
    n, parts = 600, 4
    await create_topics(
        broker.bootstrap, {names["requests"]: parts, names["results"]: 1, names["dlq"]: 1}
    )
    w = await start_worker(broker, names, parts)
    try:
        produced = await produce_all(
            broker.bootstrap,
            names["requests"],
            [(f"k{i}".encode(), request_bytes(i)) for i in range(n)],
            partition_of=lambda i: i % parts,
        )
        c = await collect(broker, [names["results"]], n)
        metrics = w.metrics()
    finally:
        exit_code = w.terminate()
    assert exit_code == 0, w.log_tail()
    # The cycle collector was settled once serving (worker.app.collector).
    assert '"gc_settled"' in w.log_tail(10_000)

    results = [rec.result() for rec in c.records[names["results"]]]
    assert len(results) == n
    by_id = {r.id: r for r in results}
    assert len(by_id) == n, "duplicate results"
    for p in produced:
        i = int(p.key.decode()[1:])  # type: ignore[union-attr]
        r = by_id[f"req-{i}"]
        assert r.status == "ok", r.error
        assert (r.source.topic, r.source.partition, r.source.offset) == (
            names["requests"],
            p.partition,
            p.offset,
        )
        assert r.meta == {"i": i}
        assert r.outputs["topk_indices"].to_numpy().shape == (3,)
        assert r.model.name == "digits" and len(r.model.version) == 16
        assert set(r.timing_us) >= {"queue", "preprocess", "infer", "total"}
    # Result keys and the id header follow the request.
    first = c.records[names["results"]][0]
    assert first.headers["id"] == first.result().id.encode()
    assert first.record_key == f"k{first.result().meta['i']}".encode()  # type: ignore[index]

    # One output partition: results of each input partition appear in offset order.
    seen: dict[int, list[int]] = defaultdict(list)
    for r in results:
        seen[r.source.partition].append(r.source.offset)
    for offsets in seen.values():
        assert offsets == sorted(offsets)

    assert mean_batch_size(metrics) > 1.0, metrics
    committed = await committed_offsets(broker.bootstrap, names["group"], names["requests"], parts)
    expected = {p: sum(1 for x in produced if x.partition == p) for p in range(parts)}
    assert committed == expected


async def test_restart_reprocesses_nothing_committed(broker: Broker, names: dict[str, str]) -> None:
    parts = 2
    await create_topics(
        broker.bootstrap, {names["requests"]: parts, names["results"]: 2, names["dlq"]: 1}
    )
    w = await start_worker(broker, names, parts)
    try:
        await produce_all(
            broker.bootstrap, names["requests"], [(None, request_bytes(i)) for i in range(100)]
        )
        await collect(broker, [names["results"]], 100)
    finally:
        assert w.terminate() == 0
    # More requests while no worker runs; a new worker must answer only these.
    await produce_all(
        broker.bootstrap, names["requests"], [(None, request_bytes(i)) for i in range(100, 150)]
    )
    w2 = await start_worker(broker, names, parts)
    try:
        c = await collect(broker, [names["results"]], 150)
    finally:
        assert w2.terminate() == 0
    ids = [rec.result().id for rec in c.records[names["results"]]]
    assert len(ids) == 150 and len(set(ids)) == 150


async def test_bad_records_dlq_and_error_results_while_neighbours_succeed(
    broker: Broker, names: dict[str, str]
) -> None:
    await create_topics(
        broker.bootstrap, {names["requests"]: 1, names["results"]: 1, names["dlq"]: 1}
    )
    garbage = b"\xc1\xc1 this is not msgpack"
    not_a_map = msgpack.packb([1, 2, 3])
    wrong_dtype = encode_request(
        Request(
            v=1,
            id="bad-dtype",
            inputs={"image": Tensor.from_numpy(np.zeros((8, 8, 1), dtype=np.float32))},
            meta={"m": 1},
        )
    )
    bad_len = msgpack.packb(
        {
            "v": 1,
            "id": "bad-len",
            "inputs": {"image": {"dtype": "uint8", "shape": [8, 8, 1], "data": b"\x00" * 10}},
        }
    )
    expired = encode_request(
        Request(
            v=1,
            id="late",
            inputs={"image": Tensor.from_numpy(np.zeros((8, 8, 1), dtype=np.uint8))},
            deadline_ms=int(time.time() * 1000) - 1000,
        )
    )
    records = [
        (b"a", request_bytes(0)),
        (b"garbage", garbage),
        (b"b", request_bytes(1)),
        (b"list", not_a_map),
        (b"c", wrong_dtype),
        (b"d", bad_len),
        (b"e", expired),
        (b"f", request_bytes(2)),
    ]
    w = await start_worker(broker, names, 1)
    try:
        produced = await produce_all(broker.bootstrap, names["requests"], records)
        c = await collect(broker, [names["results"], names["dlq"]], len(records))
        metrics = w.metrics()
    finally:
        assert w.terminate() == 0
    dlq = c.records[names["dlq"]]
    assert [(d.record_key, d.value) for d in dlq] == [(b"garbage", garbage), (b"list", not_a_map)]
    for d, src in zip(dlq, (produced[1], produced[3]), strict=True):
        assert d.headers["error.code"] == b"undecodable"
        assert d.headers["error.message"]
        assert d.headers["source.topic"] == names["requests"].encode()
        assert d.headers["source.partition"] == b"0"
        assert d.headers["source.offset"] == str(src.offset).encode()
        assert d.headers["stage"] == b"decode"
        assert d.headers["worker.version"]
    results = {r.id: r for r in (rec.result() for rec in c.records[names["results"]])}
    assert sorted(results) == ["bad-dtype", "bad-len", "late", "req-0", "req-1", "req-2"]
    for ok in ("req-0", "req-1", "req-2"):
        assert results[ok].status == "ok"
    assert results["bad-dtype"].error is not None
    assert results["bad-dtype"].error.code == "invalid_request"
    assert "dtype" in results["bad-dtype"].error.message
    assert results["bad-dtype"].meta == {"m": 1}
    assert (
        results["bad-len"].error is not None and results["bad-len"].error.code == "invalid_request"
    )
    assert results["late"].error is not None and results["late"].error.code == "deadline_exceeded"
    assert metrics["infer_dlq_produced_total"] == 2
    committed = await committed_offsets(broker.bootstrap, names["group"], names["requests"], 1)
    assert committed == {0: len(records)}
    # Issue 12: every rejection is logged with code, source and id, never the payload.
    import json

    lines = [json.loads(x) for x in w.log_tail(400).splitlines() if x.startswith("{")]
    rejected = [x for x in lines if x.get("event") == "request_rejected"]
    assert sorted((x["code"], x["id"], x["offset"]) for x in rejected) == sorted(
        [
            ("undecodable", "", 1),
            ("undecodable", "", 3),
            ("invalid_request", "bad-dtype", 4),
            ("invalid_request", "bad-len", 5),
            ("deadline_exceeded", "late", 6),
        ]
    )
    assert all(x["topic"] == names["requests"] and x["partition"] == 0 for x in rejected)
    assert not any("this is not msgpack" in line for line in w.log_tail(400).splitlines())


async def test_stale_backlog_is_answered_without_engine_time(
    broker: Broker, names: dict[str, str]
) -> None:
    """Issue 10: with ``batching.max_record_age_ms``, records whose Kafka timestamp
    is older than that are answered ``deadline_exceeded`` (counted by rule) and
    never reach the engine; fresh records next to them are answered normally."""
    from aiokafka import AIOKafkaProducer

    await create_topics(
        broker.bootstrap, {names["requests"]: 1, names["results"]: 1, names["dlq"]: 1}
    )
    w = await start_worker(broker, names, 1, INFER_WORKER_BATCHING__MAX_RECORD_AGE_MS="5000")
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    await producer.start()
    try:
        old = int(time.time() * 1000) - 60_000  # a minute-old backlog
        for i in range(20):
            stale = i % 2 == 0
            await producer.send_and_wait(
                names["requests"],
                request_bytes(i),
                key=f"k{i}".encode(),
                timestamp_ms=old if stale else None,
            )
        c = await collect(broker, [names["results"]], 20)
        metrics = await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_batch_size_sum", 0) >= 10, 30.0, "10 rows run"
        )
    finally:
        await producer.stop()
        w.terminate()
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    for i in range(20):
        res = results[f"req-{i}"]
        if i % 2 == 0:
            assert res.status == "error" and res.error is not None
            assert res.error.code == "deadline_exceeded"
            assert "max_record_age_ms" in res.error.message
        else:
            assert res.status == "ok", res.error
    assert metrics['infer_expired_total{rule="max_record_age"}'] == 10
    assert metrics["infer_batch_size_sum"] == 10  # only the fresh records ran


async def test_procs_runs_one_group_of_members_and_stops_them_together(
    broker: Broker, names: dict[str, str]
) -> None:
    """``run --procs 2``: two members share the partitions, every request is
    answered once, and one SIGTERM drains both (exit 0)."""
    from worker.ops.processes import scrape

    n, parts = 400, 4
    await create_topics(
        broker.bootstrap, {names["requests"]: parts, names["results"]: 1, names["dlq"]: 1}
    )
    w = spawn_worker(
        broker.bootstrap,
        input_topics=[names["requests"]],
        output_topic=names["results"],
        dlq_topic=names["dlq"],
        group_id=names["group"],
        command=("run", "--procs", "2"),
    )
    try:

        def assigned() -> list[float]:
            out = []
            for port in (w.metrics_port, w.metrics_port + 1):
                try:
                    out.append(scrape(port).get("infer_assigned_partitions", 0.0))
                except OSError:
                    out.append(0.0)
            return out

        deadline = time.monotonic() + 60
        while sum(assigned()) < parts or 0 in assigned():
            assert time.monotonic() < deadline, (assigned(), w.log_tail())
            await asyncio.sleep(0.2)
        await produce_all(
            broker.bootstrap,
            names["requests"],
            [(f"k{i}".encode(), request_bytes(i)) for i in range(n)],
            partition_of=lambda i: i % parts,
        )
        c = await collect(broker, [names["results"]], n)
    finally:
        code = w.terminate()
    assert code == 0, w.log_tail()
    ids = [r.result().id for r in c.records[names["results"]]]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n))
    committed = await committed_offsets(broker.bootstrap, names["group"], names["requests"], parts)
    assert sum(committed.values()) == n


async def test_a_backlog_of_small_rows_runs_in_batches_sized_from_the_model(
    broker: Broker, names: dict[str, str]
) -> None:
    """``batching.max_batch_size`` left to derive: the bundled model's 256-byte
    rows run up to 256 a batch on the CPU path (``worker.app.plan``)."""
    n, parts = 3000, 2
    await create_topics(
        broker.bootstrap, {names["requests"]: parts, names["results"]: 1, names["dlq"]: 1}
    )
    await produce_all(
        broker.bootstrap,
        names["requests"],
        [(f"k{i}".encode(), request_bytes(i)) for i in range(n)],
        partition_of=lambda i: i % parts,
    )
    w = await start_worker(broker, names, parts)
    try:
        await collect(broker, [names["results"]], n)
        metrics = w.metrics()
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert '"batch_size_derived"' in w.log_tail(10_000)
    (up_to_64,) = (v for k, v in metrics.items()
                   if k.startswith("infer_batch_size_bucket") and 'le="64.0"' in k)  # fmt: skip
    above = metrics["infer_batch_size_count"] - up_to_64
    assert above >= 1, metrics
