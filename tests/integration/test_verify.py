"""The delivery verifier against the real embedded broker: a real worker's output
verifies clean, and a request made after the worker stopped, or a result record
copied onto the output topic, shows up as exactly that loss or duplicate."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from worker.contract import (
    ModelInfo,
    Request,
    Result,
    Source,
    Tensor,
    encode_request,
    encode_result,
)
from worker.contract.oip import CONTENT_TYPE, encode_oip_result
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import (
    Duplicate,
    InputRecord,
    Observed,
    Report,
    add_arguments,
    check,
    read_topics,
    run,
)

pytestmark = pytest.mark.integration

IDLE = 1.0


def request_bytes(i: int) -> bytes:
    img = np.random.default_rng(i).integers(0, 256, (8, 8, 1), dtype=np.uint8)
    return encode_request(Request(v=1, id=f"req-{i}", inputs={"image": Tensor.from_numpy(img)}))


async def read_and_check(
    broker: Broker, names: dict[str, str], *, strict: bool = False
) -> tuple[Report, Observed]:
    inputs, observed = await read_topics(
        broker.bootstrap, [names["requests"]], names["results"], names["dlq"], idle_timeout=IDLE
    )
    assert observed.complete
    return check(
        inputs, observed.answers, unparseable=observed.unparseable, strict=strict
    ), observed


async def wait_for_answers(broker: Broker, names: dict[str, str], n: int) -> None:
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    await c.start()
    try:
        assert await c.collect(lambda c: c.count() >= n, 60.0), f"{c.count()} of {n} answers"
    finally:
        await c.stop()


def cli_args(broker: Broker, names: dict[str, str], *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(
        [
            "--bootstrap-servers",
            broker.bootstrap,
            "--input-topics",
            names["requests"],
            "--output-topic",
            names["results"],
            "--dlq-topic",
            names["dlq"],
            "--idle-timeout",
            str(IDLE),
            *extra,
        ]
    )


async def test_worker_output_verifies_then_loss_and_duplicate_are_pinpointed(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    parts, n = 2, 30
    await create_topics(
        broker.bootstrap, {names["requests"]: parts, names["results"]: 1, names["dlq"]: 1}
    )
    w = spawn_worker(
        broker.bootstrap,
        input_topics=[names["requests"]],
        output_topic=names["results"],
        dlq_topic=names["dlq"],
        group_id=names["group"],
    )
    try:
        await asyncio.to_thread(
            w.wait_until,
            lambda m: m.get("infer_assigned_partitions", 0) >= parts,
            60.0,
            "partition assignment",
        )
        # Two undecodable records: the DLQ answers them, and that counts as answered.
        records = [(None, request_bytes(i)) for i in range(n)]
        records += [(None, b"\xc1 not msgpack"), (None, b"\xc1 nor this")]
        await produce_all(
            broker.bootstrap, names["requests"], records, partition_of=lambda i: i % parts
        )
        await wait_for_answers(broker, names, len(records))
        report, _ = await read_and_check(broker, names)
    finally:
        assert w.terminate() == 0, w.log_tail()

    assert report.ok, report.format()
    t = report.totals
    assert (t.partitions, t.requests, t.answered) == (parts, n + 2, n + 2)
    assert (t.results, t.dlq) == (n, 2)
    assert (t.lost, t.duplicates, t.ordering_violations, t.unknown, t.unparseable) == (0,) * 5

    # A request nobody will answer: exactly that offset is lost.
    (extra,) = await produce_all(
        broker.bootstrap, names["requests"], [(None, request_bytes(n))], partition_of=lambda i: 1
    )
    report, _ = await read_and_check(broker, names)
    assert not report.ok
    assert [(p.partition, p.lost) for p in report.partitions] == [(0, ()), (1, (extra.offset,))]
    assert report.totals.lost == 1 and report.totals.duplicates == 0

    # A copy of one result on the output topic: exactly that source is duplicated.
    c = Collector(broker.bootstrap, [names["results"]])
    await c.start()
    try:
        assert await c.collect(lambda c: c.count() >= 1, 30.0)
    finally:
        await c.stop()
    original = c.records[names["results"]][0]
    src = original.result().source
    await produce_all(broker.bootstrap, names["results"], [(original.record_key, original.value)])
    report, _ = await read_and_check(broker, names)
    by_partition = {p.partition: p for p in report.partitions}
    assert by_partition[src.partition].duplicates == (Duplicate(src.offset, results=2, dlq=0),)
    assert report.totals.duplicates == 1 and report.totals.surplus_answers == 1
    # A replayed answer is a duplicate, not a reordering.
    assert report.totals.ordering_violations == 0
    assert report.totals.lost == 1  # the extra request is still unanswered

    # The command line says the same, with a non-zero exit and a JSON report.
    out = tmp_path / "verify.json"
    code = await asyncio.to_thread(run, cli_args(broker, names, "--json", str(out)))
    assert code == 1
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["complete"] is True
    assert doc["totals"]["lost"] == 1 and doc["totals"]["duplicates"] == 1
    lost = {(p["partition"], o) for p in doc["partitions"] for o in p["lost"]}
    assert lost == {(1, extra.offset)}


async def test_read_topics_parses_records_and_reports_unparseable_ones(
    broker: Broker, names: dict[str, str]
) -> None:
    req, res, dlq = names["requests"], names["results"], names["dlq"]
    await create_topics(broker.bootstrap, {req: 2, res: 2, dlq: 1})
    produced = await produce_all(
        broker.bootstrap,
        req,
        [(None, request_bytes(i)) for i in range(3)],
        partition_of=lambda i: 0,
    )
    assert [p.offset for p in produced] == [0, 1, 2]

    def result(offset: int) -> bytes:
        return encode_result(
            Result(id="x", status="ok", source=Source(req, 0, offset), model=ModelInfo("m", "v"))
        )

    JSON = CONTENT_TYPE.encode()

    def oip(offset: int) -> bytes:
        outputs = {"out": np.zeros((1, 2), np.float32)}
        return encode_oip_result("y", ModelInfo("m", "v"), Source(req, 0, offset), {}, None,
                                 outputs)  # fmt: skip

    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    await producer.start()
    try:
        acks = [
            await producer.send(res, result(0), partition=1),
            # An Open Inference Protocol JSON answer, told by its content type.
            await producer.send(res, oip(1), partition=1, headers=[("content-type", JSON)]),
            await producer.send(res, b"\xc1 corrupt", partition=0),
            await producer.send(
                dlq,
                b"raw request",
                headers=[
                    ("source.topic", req.encode()),
                    ("source.partition", b"0"),
                    ("source.offset", b"2"),
                ],
            ),
            await producer.send(dlq, b"no headers"),
            await producer.send(
                dlq,
                b"bad offset",
                headers=[
                    ("source.topic", req.encode()),
                    ("source.partition", b"0"),
                    ("source.offset", b"+2"),
                ],
            ),
        ]
        await asyncio.gather(*acks)
    finally:
        await producer.stop()

    inputs, observed = await read_topics(broker.bootstrap, [req], res, dlq, idle_timeout=IDLE)
    assert observed.complete
    assert inputs == {req: {0: [0, 1, 2], 1: []}}  # the empty partition is listed too
    assert sorted(
        (a.kind, a.source, a.output_partition, a.output_offset) for a in observed.answers
    ) == [
        ("dlq", InputRecord(req, 0, 2), 0, 0),
        ("result", InputRecord(req, 0, 0), 1, 0),
        ("result", InputRecord(req, 0, 1), 1, 1),
    ]
    bad = sorted(observed.unparseable)
    assert [(u.topic, u.partition, u.offset) for u in bad] == [
        (dlq, 0, 1),
        (dlq, 0, 2),
        (res, 0, 0),
    ]
    assert "source.offset" in bad[0].reason and "decimal" in bad[1].reason
    assert bad[2].reason.startswith("not a result")

    report = check(inputs, observed.answers, unparseable=observed.unparseable)
    assert report.ok
    assert report.totals.unparseable == 3 and report.totals.answered == 3
    assert [p.partition for p in report.partitions] == [0, 1]
