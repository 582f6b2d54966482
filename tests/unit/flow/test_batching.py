"""Flush rules of the micro-batcher, with an injected clock (no sleeps)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from worker.flow.batching import BatchPolicy, MicroBatcher
from worker.flow.messages import Batch
from worker.flow.room import Room


@dataclass
class Item:
    arrived: float
    deadline: float | None = None
    n: int = 0


def policy(
    max_size: int = 4, delay: float = 0.010, preferred: tuple[int, ...] = ()
) -> BatchPolicy[Item]:
    return BatchPolicy(max_batch_size=max_size, max_queue_delay=delay, preferred_sizes=preferred)


def test_flushes_when_full() -> None:
    p = policy(max_size=3)
    for i in range(4):
        p.add(Item(arrived=0.0, n=i))
    batch = p.take(0.0, queue_drained=False)
    assert batch is not None and batch.reason == "full"
    assert [i.n for i in batch.items] == [0, 1, 2]
    assert len(p) == 1


def test_waits_until_delay_measured_from_oldest() -> None:
    p = policy(delay=0.010)
    p.add(Item(arrived=1.000))
    p.add(Item(arrived=1.008))
    assert p.take(1.009, queue_drained=True) is None
    assert p.next_flush_at() == pytest.approx(1.010)
    batch = p.take(1.010, queue_drained=True)
    assert batch is not None and batch.reason == "delay" and len(batch) == 2


def test_preferred_size_sent_without_waiting_only_when_queue_drained() -> None:
    p = policy(max_size=8, preferred=(2, 4))
    for _ in range(4):
        p.add(Item(arrived=0.0))
    assert p.take(0.0, queue_drained=False) is None  # more may be right behind
    batch = p.take(0.0, queue_drained=True)
    assert batch is not None and batch.reason == "preferred" and len(batch) == 4


def test_non_preferred_count_waits_for_delay() -> None:
    p = policy(max_size=8, preferred=(4,))
    for _ in range(3):
        p.add(Item(arrived=0.0))
    assert p.take(0.0, queue_drained=True) is None


def test_near_deadline_flushes_early_using_service_time() -> None:
    p = policy(delay=1.0)
    p.observe_service_time(0.004)
    p.add(Item(arrived=0.0))
    p.add(Item(arrived=0.0, deadline=0.020))
    assert p.next_flush_at() == pytest.approx(0.016)
    assert p.take(0.015, queue_drained=True) is None
    batch = p.take(0.016, queue_drained=True)
    assert batch is not None and batch.reason == "deadline" and len(batch) == 2


def test_service_time_is_smoothed() -> None:
    p = policy()
    p.observe_service_time(0.010)
    p.observe_service_time(0.020)
    assert 0.010 < p.service_time < 0.020


def test_drain_returns_everything_and_seq_increases() -> None:
    p = policy(max_size=2)
    for _ in range(3):
        p.add(Item(arrived=0.0))
    first = p.take(0.0, queue_drained=False)
    last = p.drain(0.0)
    assert first is not None and last is not None
    assert last.reason == "drain" and len(last) == 1 and last.seq == first.seq + 1
    assert p.drain(0.0) is None


async def test_microbatcher_stage_drains_on_end_of_stream() -> None:
    src: asyncio.Queue[Item | None] = asyncio.Queue()
    out: asyncio.Queue[Batch[Item] | None] = asyncio.Queue()
    stage = MicroBatcher(src, out, policy(max_size=4, delay=60.0))
    for i in range(6):
        src.put_nowait(Item(arrived=0.0, n=i))
    src.put_nowait(None)
    await asyncio.wait_for(stage.run(), 5)
    sizes = []
    while (b := out.get_nowait()) is not None:
        sizes.append([i.n for i in b.items])
    assert sizes == [[0, 1, 2, 3], [4, 5]]


async def test_microbatcher_flushes_on_delay_with_real_loop() -> None:
    src: asyncio.Queue[Item | None] = asyncio.Queue()
    out: asyncio.Queue[Batch[Item] | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    stage = MicroBatcher(src, out, policy(max_size=64, delay=0.02), clock=loop.time)
    task = asyncio.create_task(stage.run())
    src.put_nowait(Item(arrived=loop.time()))
    batch = await asyncio.wait_for(out.get(), 5)
    assert batch is not None and batch.reason == "delay" and len(batch) == 1
    src.put_nowait(None)
    await asyncio.wait_for(task, 5)


async def test_a_due_batch_waits_for_room_and_takes_what_arrived_meanwhile() -> None:
    """The engine busy (no room), a batch past its delay is not cut: requests
    keep joining it, and it is cut, larger, when the engine can start it."""
    src: asyncio.Queue[Item | None] = asyncio.Queue()
    out: asyncio.Queue[Batch[Item] | None] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    room = Room(1)
    room.take()  # a batch already running
    stage = MicroBatcher(src, out, policy(max_size=64, delay=0.001), clock=loop.time, room=room)
    task = asyncio.create_task(stage.run())
    for n in range(3):
        src.put_nowait(Item(arrived=loop.time(), n=n))
        await asyncio.sleep(0.01)
    assert out.empty()
    room.give_back()
    batch = await asyncio.wait_for(out.get(), 5)
    assert batch is not None and batch.reason == "delay" and [i.n for i in batch.items] == [0, 1, 2]
    room.give_back()
    src.put_nowait(None)
    await asyncio.wait_for(task, 5)
    assert await out.get() is None


def test_room_counts_batches_between_cut_and_done() -> None:
    room = Room(2)
    room.take()
    room.take()
    assert not room.free
    room.give_back()
    assert room.free
    with pytest.raises(ValueError, match="size must be >= 1"):
        Room(0)


async def test_a_batcher_cancelled_while_the_engine_is_busy_takes_no_item_later() -> None:
    """Cancelled while it waits for an item or room (a second signal abandons the
    drain), the batcher leaves no pending read on the queue behind it."""
    src: asyncio.Queue[Item | None] = asyncio.Queue()
    out: asyncio.Queue[Batch[Item] | None] = asyncio.Queue()
    room = Room(1)
    room.take()
    task = asyncio.create_task(MicroBatcher(src, out, policy(max_size=4), room=room).run())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    src.put_nowait(Item(arrived=0.0))
    await asyncio.sleep(0.01)
    assert src.qsize() == 1
