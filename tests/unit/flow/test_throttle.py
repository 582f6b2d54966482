"""A lane's rate cap (``[[kafka.lanes]] max_records_per_s``, issue 39): the
token bucket, and both batching policies held to it (a lane served by a process
of its own uses the one-lane ``BatchPolicy``; lanes of one process share a
``LanePolicy``). Injected clock, but for one real batcher run."""

from __future__ import annotations

import asyncio
import time

import pytest

from worker.app.lanes import batch_policy
from worker.config import load_settings
from worker.flow.batching import BatchPolicy, MicroBatcher, Policy
from worker.flow.lanes import Lane, LanePolicy
from worker.flow.messages import Batch
from worker.flow.throttle import Throttle
from worker.ops.processes import override_env

from .test_lanes import Item


def run_until(p: Policy[Item], end: float) -> list[tuple[float, Batch[Item]]]:
    """Cut batches as the batcher would, waking at each ``next_flush_at``, from
    time 0 until ``end``. Fails on a wake-up that cuts nothing and names no
    later time (the batcher would spin)."""
    cuts: list[tuple[float, Batch[Item]]] = []
    now = 0.0
    while now <= end:
        batch = p.take(now, queue_drained=True)
        if batch is not None:
            cuts.append((now, batch))
            continue
        at = p.next_flush_at()
        if at is None:
            break
        assert at > now, f"due at {at} but nothing cut at {now}"
        now = at
    return cuts


def test_the_bucket_gives_one_burst_then_the_rate() -> None:
    t = Throttle(rate=1000.0, burst=100)
    assert t.ready_at(100) == -float("inf") and t.available(0.0) == 100
    t.take(100, 0.0)
    assert t.available(0.0) == 0
    assert t.ready_at(100) == pytest.approx(0.1)
    assert t.available(0.05) == 50
    assert t.available(10.0) == 100  # never more than one burst after an idle spell


def test_a_capped_one_lane_policy_cuts_full_batches_at_the_rate() -> None:
    p: BatchPolicy[Item] = BatchPolicy(100, 0.002, throttle=Throttle(1000.0, 100))
    for n in range(2000):
        p.add(Item(0, n))
    cuts = run_until(p, 1.0)
    times = [at for at, _ in cuts]
    assert all(len(b) == 100 and b.reason == "full" for _, b in cuts)
    # One burst at once, then one batch each 100 ms: 1,000 a second.
    assert times == pytest.approx([0.0, *(0.1 * k for k in range(1, 11))])
    assert [i.n for _, b in cuts for i in b.items] == list(range(1100))


def test_without_a_cap_the_backlog_goes_at_once() -> None:
    p: BatchPolicy[Item] = BatchPolicy(100, 0.002)
    for n in range(2000):
        p.add(Item(0, n))
    assert [at for at, _ in run_until(p, 1.0)] == [0.0] * 20


def test_a_capped_lane_with_a_few_requests_waits_for_its_delay_and_its_rate() -> None:
    p: BatchPolicy[Item] = BatchPolicy(100, 0.002, throttle=Throttle(1000.0, 100))
    for n in range(100):
        p.add(Item(0, n))
    assert p.take(0.0, queue_drained=True) is not None  # the burst
    for n in range(30):
        p.add(Item(0, n, arrived=0.001))
    assert p.take(0.003, queue_drained=True) is None  # its delay passed, not its rate
    assert p.next_flush_at() == pytest.approx(0.030)
    batch = p.take(0.030, queue_drained=True)
    assert batch is not None and len(batch) == 30


URGENT = Lane(0, "urgent", delay=0.002)
CAPPED = Lane(1, "bulk", delay=0.010, max_rate=500.0)


def test_the_urgent_lane_is_not_held_by_a_lower_lanes_cap() -> None:
    p = LanePolicy([URGENT, CAPPED], lambda i: i.lane, 50, capacity=10_000)
    for n in range(5000):
        p.add(Item(1, n))
    for _ in range(2):  # the lower lane's burst: two batches
        first = p.take(0.0, queue_drained=True)
        assert first is not None and len(first) == 50
    for n in range(3):
        p.add(Item(0, 100 + n, arrived=0.001))
    assert p.take(0.001, queue_drained=True) is None  # the urgent lane's delay, 2 ms
    batch = p.take(0.003, queue_drained=True)
    # The urgent requests, and the lower lane's 1 row its cap allowed since.
    assert batch is not None and [i.lane for i in batch.items] == [0, 0, 0, 1]


def test_a_capped_lower_lane_gets_its_rate_and_never_an_empty_batch() -> None:
    p = LanePolicy([URGENT, CAPPED], lambda i: i.lane, 50, capacity=10_000)
    for n in range(5000):
        p.add(Item(1, n, deadline=0.0))  # already late: a capped lane's deadlines wait too
    cuts = run_until(p, 2.05)
    rows = sum(len(b) for _, b in cuts)
    assert all(len(b) == 50 for _, b in cuts)
    assert rows == 100 + 500 * 2  # a burst of two batches, then 500 a second
    ns = [i.n for _, b in cuts for i in b.items]
    assert ns == sorted(ns)  # in order


def test_min_share_is_kept_within_the_cap() -> None:
    capped = Lane(1, "bulk", delay=0.010, min_share=0.5, max_rate=100.0)
    p = LanePolicy([URGENT, capped], lambda i: i.lane, 10, capacity=10_000)
    for n in range(100):
        p.add(Item(0, n))
        p.add(Item(1, n))
    first = p.take(0.0, queue_drained=True)
    assert first is not None and [i.lane for i in first.items].count(1) == 5
    second = p.take(0.0, queue_drained=True)
    assert second is not None and [i.lane for i in second.items].count(1) == 5
    for _ in range(2):
        more = p.take(0.0, queue_drained=True)
        assert more is not None and [i.lane for i in more.items].count(1) == 5
    fifth = p.take(0.0, queue_drained=True)  # its burst of 20 spent: urgent rows only
    assert fifth is not None and [i.lane for i in fifth.items] == [0] * 10


def test_settings_give_each_policy_its_lanes_cap() -> None:
    lanes = '[{topics = ["a"]}, {topics = ["b"], priority = 1, max_records_per_s = 800}]'
    shared = load_settings(env=override_env({"kafka.input_topics": "a,b", "kafka.lanes": lanes}))
    p = batch_policy(shared)
    assert isinstance(p, LanePolicy) and [lane.max_rate for lane in p.lanes] == [0.0, 800.0]
    alone = '[{topics = ["b"], priority = 1, max_records_per_s = 800}]'
    member = load_settings(env=override_env({"kafka.input_topics": "b", "kafka.lanes": alone}))
    q = batch_policy(member)
    assert isinstance(q, BatchPolicy) and q.throttle is not None and q.throttle.rate == 800.0
    assert q.throttle.burst == 2 * q.max_batch_size


async def test_the_batcher_waits_for_the_cap_and_loses_nothing() -> None:
    items: asyncio.Queue[Item | None] = asyncio.Queue()
    batches: asyncio.Queue[Batch[Item] | None] = asyncio.Queue()
    p: BatchPolicy[Item] = BatchPolicy(10, 0.001, throttle=Throttle(2000.0, 10))
    for n in range(60):
        items.put_nowait(Item(0, n, arrived=time.monotonic()))
    started = time.monotonic()
    task = asyncio.create_task(MicroBatcher(items, batches, p).run())
    got: list[int] = []
    while len(got) < 60:
        batch = await asyncio.wait_for(batches.get(), 5)
        assert batch is not None
        got.extend(i.n for i in batch.items)
    took = time.monotonic() - started
    items.put_nowait(None)
    await asyncio.wait_for(task, 5)
    assert got == list(range(60))
    assert took >= 0.024  # 10 at once, then 50 at 2,000 a second: 25 ms at least
