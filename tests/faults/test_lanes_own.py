"""A lane of its own (``own_process = true``, issue 39), on both brokers: ``run``
serves the urgent lane from a second process of the same group, which answers
urgent requests produced while the first drains a bulk backlog, each process
batching its own lane only; a SIGKILL of the urgent process stops the other
(drained) and, once ``run`` is started again, nothing of either lane is lost;
under exactly-once (Apache Kafka) each request is answered once across a SIGKILL
of the whole tree, the two processes holding transactional ids of their own."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Mapping

import pytest

from worker.ops.broker import Broker
from worker.ops.processes import WorkerProcess
from worker.ops.topics import produce_all
from worker.ops.verify import check, read_topics

from .conftest import no_crash_in_log, request, wait_assigned
from .test_lanes import (
    BULK,
    PARTS,
    URGENT,
    _backlog,
    _dispatched,
    by_topic,
    members,
    start_with_lanes,
    until,
)

pytestmark = pytest.mark.faults


def _urgent_member(w: WorkerProcess) -> WorkerProcess:
    """The urgent lane's process, seen through its metrics (member 1)."""
    return WorkerProcess(w.proc, w.metrics_port + 1, w.log_path)


def _child_serving(supervisor: int, topic: str) -> int:
    """The pid of the supervisor's child whose input topics are ``topic``."""
    with open(f"/proc/{supervisor}/task/{supervisor}/children") as fh:
        pids = [int(p) for p in fh.read().split()]
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
        if env.get(b"INFER_WORKER_KAFKA__INPUT_TOPICS") == f'["{topic}"]'.encode():
            return pid
    raise AssertionError(f"no child of {supervisor} serves {topic} alone: {pids}")


async def _urgent(broker: Broker, urgent: str, first: int) -> None:
    await produce_all(
        broker.bootstrap,
        urgent,
        [(f"u{i}".encode(), request(100_000 + i)) for i in range(first, first + URGENT)],
        partition_of=lambda i: i % PARTS,
        rate=URGENT / 0.1,  # spread over ~0.1 s
    )


async def test_a_lane_of_its_own_is_served_apart_and_a_sigkill_loses_nothing(
    broker: Broker, names: dict[str, str]
) -> None:
    urgent, bulk = await _backlog(broker, names)
    async with members(broker, names) as (answers, workers):
        w = start_with_lanes(broker, names, own=True)
        workers.started.append(w)
        alone = _urgent_member(w)
        await wait_assigned([w, alone], 2 * PARTS)
        await until(lambda: _dispatched(w, "bulk") >= 500, 60, "bulk under way")
        await _urgent(broker, urgent, 0)
        await until(lambda: _dispatched(alone, "urgent") >= URGENT, 60, "urgent dispatched")
        # Each process holds its own lane only: no urgent request is batched in
        # the bulk lane's process, whatever it has waiting. How soon the urgent
        # lane answers beside a drain is bench.lanes' measure (``lanes-own``):
        # the bulk lane's process, without lanes, drains this backlog on Kafka
        # before a test could time an order.
        assert _dispatched(w, "urgent") == 0 and _dispatched(alone, "bulk") == 0
        os.kill(_child_serving(w.pid, urgent), signal.SIGKILL)
        # A member gone stops the other, drained: not a half-served group.
        assert w.proc.wait(60) != 0
        w2 = start_with_lanes(broker, names, own=True)
        workers.started.append(w2)
        await _urgent(broker, urgent, URGENT)
        await until(lambda: by_topic(answers.collector)[bulk] >= BULK, 120, "backlog answered")
        await until(
            lambda: by_topic(answers.collector)[urgent] >= 2 * URGENT, 60, "urgent answered"
        )
        assert w2.terminate() == 0, w2.log_tail()
        no_crash_in_log(w2)


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_exactly_once_with_a_lane_of_its_own_answers_each_request_once(
    broker: Broker, names: dict[str, str]
) -> None:
    urgent, bulk = await _backlog(broker, names)
    eos = {
        "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
        "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "lanes-member",
    }
    w = start_with_lanes(broker, names, own=True, **eos)
    try:
        await wait_assigned([w, _urgent_member(w)], 2 * PARTS)
        await _urgent(broker, urgent, 0)
        w.kill()  # the whole tree, mid-stream: the next members abort what was open
        w = start_with_lanes(broker, names, own=True, **eos)
        await wait_assigned([w, _urgent_member(w)], 2 * PARTS)
        await _urgent(broker, urgent, URGENT)
        inputs: Mapping[str, object] = {}
        observed = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            inputs, observed = await read_topics(
                broker.bootstrap, [urgent, bulk], names["results"], names["dlq"],
                idle_timeout=1.0, isolation_level="read_committed",
            )  # fmt: skip
            if len(observed.answers) >= BULK + 2 * URGENT:
                break
            await asyncio.sleep(1.0)
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        w.kill()
    assert observed is not None
    report = check(inputs, observed.answers, unparseable=observed.unparseable, strict=True)  # type: ignore[arg-type]
    assert report.totals.lost == 0 and report.totals.surplus_answers == 0, report.format()
