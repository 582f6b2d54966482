"""A lane held to a rate (``max_records_per_s``, issue 39), on both brokers,
with the lanes in one process and with the urgent lane in a process of its own:
the capped bulk lane is dispatched no faster than its cap allows, the urgent
lane above it is not held by it, and every request of both lanes is answered."""

from __future__ import annotations

import time

import pytest

from worker.ops.broker import Broker
from worker.ops.topics import produce_all

from .conftest import no_crash_in_log, request, wait_assigned
from .test_lanes import (
    PARTS,
    URGENT,
    _backlog,
    _dispatched,
    members,
    processes,
    produce_urgent,
    start_with_lanes,
    until,
)

pytestmark = pytest.mark.faults

BACKLOG, RATE = 1_800, 600.0  # 3 s of backlog
BATCH = 64  # max_batch_size: the bucket holds two batches (BURST_BATCHES)


@pytest.mark.parametrize("own", [False, True], ids=["one-process", "own-process"])
async def test_a_capped_lane_keeps_its_rate_and_the_lane_above_is_not_held(
    broker: Broker, names: dict[str, str], own: bool
) -> None:
    await capped_lane_keeps_its_rate(broker, names, own)


async def capped_lane_keeps_its_rate(
    broker: Broker, names: dict[str, str], own: bool, assign_s: float = 60, **env: str
) -> None:
    """The check, with ``env`` for the worker (the GPU test's engine) and
    ``assign_s`` for its start."""
    urgent, bulk = await _backlog(broker, names, 0)
    async with members(broker, names) as (_, workers):
        w = start_with_lanes(broker, names, own=own, bulk_rate=RATE,
                             INFER_WORKER_BATCHING__MAX_BATCH_SIZE=str(BATCH), **env)  # fmt: skip
        workers.started.append(w)
        bulk_member, urgent_member = processes(w, own)[0], processes(w, own)[-1]
        await wait_assigned(processes(w, own), 2 * PARTS, timeout=assign_s)
        # Produced once both lanes are served: a second process joining late
        # would otherwise find the backlog half through.
        backlog = [(f"b{i}".encode(), request(i)) for i in range(BACKLOG)]
        await produce_all(broker.bootstrap, bulk, backlog, partition_of=lambda i: i % PARTS)
        await until(lambda: _dispatched(bulk_member, "bulk") >= 100, 60, "bulk under way")
        t0, at_t0 = time.monotonic(), _dispatched(bulk_member, "bulk")
        await produce_urgent(broker, urgent, 0)
        await until(lambda: _dispatched(urgent_member, "urgent") >= URGENT, 30, "urgent")
        print("URGENT", time.monotonic() - t0, at_t0, _dispatched(bulk_member, "bulk"))  # the log
        # Not held by the cap below it: dispatched while most of the backlog waits.
        assert _dispatched(bulk_member, "bulk") <= BACKLOG - 300
        await until(lambda: _dispatched(bulk_member, "bulk") >= BACKLOG, 60, "backlog through")
        took = time.monotonic() - t0
        # At most two batches at once (the bucket may be full at t0), then RATE a second.
        least = (BACKLOG - at_t0 - 2 * BATCH) / RATE
        assert took >= least, f"{BACKLOG - at_t0} bulk rows in {took:.2f} s (cap: {least:.2f})"
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
