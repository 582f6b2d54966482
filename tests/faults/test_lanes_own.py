"""A lane of its own (``own_process = true``, issue 39), on both brokers: ``run``
serves the urgent lane from a second process of the same group, which answers
urgent requests produced while the first drains a bulk backlog, each process
batching its own lane only; a SIGKILL of the urgent process stops the other
(drained) and, once ``run`` is started again, nothing of either lane is lost.
Exactly-once with a lane of its own is ``test_lanes.py``'s exactly-once test."""

from __future__ import annotations

import os
import signal

import pytest

from worker.ops.broker import Broker

from .conftest import no_crash_in_log, wait_assigned
from .test_lanes import (
    BULK,
    PARTS,
    URGENT,
    _backlog,
    _dispatched,
    by_topic,
    members,
    processes,
    produce_urgent,
    start_with_lanes,
    until,
)

pytestmark = pytest.mark.faults


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


async def test_a_lane_of_its_own_is_served_apart_and_a_sigkill_loses_nothing(
    broker: Broker, names: dict[str, str]
) -> None:
    urgent, bulk = await _backlog(broker, names)
    async with members(broker, names) as (answers, workers):
        w = start_with_lanes(broker, names, own=True)
        workers.started.append(w)
        _, alone = processes(w, own=True)
        await wait_assigned([w, alone], 2 * PARTS)
        await until(lambda: _dispatched(w, "bulk") >= 500, 60, "bulk under way")
        await produce_urgent(broker, urgent, 0)
        await until(lambda: _dispatched(alone, "urgent") >= URGENT, 60, "urgent dispatched")
        # Each process holds its own lane only: no urgent request is batched in
        # the bulk lane's process, whatever it has waiting. How soon the urgent
        # lane answers beside a drain is benchmarks.lanes' measure (``lanes-own``):
        # the bulk lane's process, without lanes, drains this backlog on Kafka
        # before a test could time an order.
        assert _dispatched(w, "urgent") == 0 and _dispatched(alone, "bulk") == 0
        os.kill(_child_serving(w.pid, urgent), signal.SIGKILL)
        # A member gone stops the other, drained: not a half-served group.
        assert w.proc.wait(60) != 0
        w2 = start_with_lanes(broker, names, own=True)
        workers.started.append(w2)
        await produce_urgent(broker, urgent, URGENT)
        await until(lambda: by_topic(answers.collector)[bulk] >= BULK, 120, "backlog answered")
        await until(
            lambda: by_topic(answers.collector)[urgent] >= 2 * URGENT, 60, "urgent answered"
        )
        assert w2.terminate() == 0, w2.log_tail()
        no_crash_in_log(w2)
