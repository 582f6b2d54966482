"""The failure budget end to end: a run of undecodable records stops the worker
at the record that exceeds ``dlq.max_consecutive``, naming it, with nothing from
it on committed (issue 36 counts the budget per batch: this holds that a batch
is still judged record by record). The batch holding that record is not
delivered at all: the worker halts before sending it."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.test_pipeline import collect, request_bytes, start_worker
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import committed_offsets, produce_all

pytestmark = pytest.mark.integration

GOOD, BAD, MAX_CONSECUTIVE = 40, 60, 25


async def test_consecutive_failures_halt_the_worker_at_the_record_that_exceeds_the_budget(
    broker: Broker, names: dict[str, str]
) -> None:
    await create_topics(
        broker.bootstrap, {names["requests"]: 1, names["results"]: 1, names["dlq"]: 1}
    )
    w = await start_worker(broker, names, 1, INFER_WORKER_DLQ__MAX_CONSECUTIVE=str(MAX_CONSECUTIVE))
    try:
        good = [(b"k", request_bytes(i)) for i in range(GOOD)]
        await produce_all(broker.bootstrap, names["requests"], good)
        c = await collect(broker, [names["results"]], GOOD)
        bad = [(b"k", b"\xc1 not msgpack") for _ in range(BAD)]
        await produce_all(broker.bootstrap, names["requests"], bad)
        exit_code = await asyncio.to_thread(w.proc.wait, 60.0)
    finally:
        w.kill()
    log = w.log_tail(20_000)
    assert exit_code != 0, log
    assert f"{MAX_CONSECUTIVE} consecutive failed records" in log, log
    # The record that exceeded the budget is named: the 25th undecodable one.
    assert f"{names['requests']}:0@{GOOD + MAX_CONSECUTIVE - 1}" in log, log
    assert len(c.records[names["results"]]) == GOOD
    committed = await committed_offsets(broker.bootstrap, names["group"], names["requests"], 1)
    # Nothing from the record that halted it on counts as answered.
    assert committed.get(0, 0) <= GOOD + MAX_CONSECUTIVE - 1, committed
