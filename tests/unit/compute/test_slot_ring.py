"""SlotRing rotation and accounting on CPU, with fake slots (no CUDA).

The fake slots allocate NumPy buffers through the same ``Allocations`` counter the
CUDA slots use, so "nothing is allocated after start-up" is asserted the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from worker.compute.gpu.slots import Allocations, SlotLayout, SlotRing, pack_images
from worker.flow.errors import EngineDead
from worker.model.io import TensorDesc


@dataclass(eq=False)
class FakeSlot:
    index: int
    staging: np.ndarray
    output: np.ndarray


def fake_slot(index: int, allocations: Allocations) -> FakeSlot:
    staging = np.zeros(1024, np.uint8)
    allocations.record(staging.nbytes)
    output = np.zeros((8, 10), np.float32)
    allocations.record(output.nbytes)
    return FakeSlot(index, staging, output)


def make_ring(n: int = 3) -> SlotRing[FakeSlot]:
    allocations = Allocations()
    return SlotRing([fake_slot(i, allocations) for i in range(n)], allocations)


async def test_round_robin_order() -> None:
    ring = make_ring(3)
    order = []
    for _ in range(7):
        slot = await ring.acquire()
        order.append(slot.index)
        ring.release(slot)
    assert order == [0, 1, 2, 0, 1, 2, 0]


async def test_out_of_order_release_serves_longest_idle_first() -> None:
    ring = make_ring(3)
    a, _b, c = [await ring.acquire() for _ in range(3)]
    ring.release(c)
    ring.release(a)
    assert (await ring.acquire()).index == 2
    assert (await ring.acquire()).index == 0


async def test_acquire_waits_when_all_busy_and_wakes_on_release() -> None:
    ring = make_ring(2)
    first, second = await ring.acquire(), await ring.acquire()
    assert ring.free == 0 and ring.busy == 2
    waiter = asyncio.create_task(ring.acquire())
    await asyncio.sleep(0)  # let it run up to its wait (a yield, not a timed wait)
    assert not waiter.done() and ring.waiting == 1
    assert ring.try_acquire() is None
    ring.release(second)
    assert await asyncio.wait_for(waiter, 1.0) is second
    assert ring.busy == 2 and ring.free == 0  # handed over directly, still busy
    ring.release(first)
    ring.release(second)
    assert ring.free == 2 and ring.busy == 0


async def test_waiters_are_served_first_come_first_served() -> None:
    ring = make_ring(1)
    held = await ring.acquire()
    got: list[str] = []

    async def take(name: str) -> None:
        slot = await ring.acquire()
        got.append(name)
        ring.release(slot)

    tasks = [asyncio.create_task(take(n)) for n in ("a", "b", "c")]
    await asyncio.sleep(0)
    assert ring.waiting == 3
    ring.release(held)
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert got == ["a", "b", "c"]
    assert ring.free == 1


async def test_cancelled_waiter_does_not_lose_a_slot() -> None:
    ring = make_ring(1)
    held = await ring.acquire()
    doomed = asyncio.create_task(ring.acquire())
    survivor = asyncio.create_task(ring.acquire())
    await asyncio.sleep(0)
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    ring.release(held)
    assert await asyncio.wait_for(survivor, 1.0) is held
    ring.release(held)
    assert ring.free == 1 and ring.waiting == 0


async def test_no_allocation_after_start_up() -> None:
    ring = make_ring(3)
    after_start = (ring.allocations.count, ring.allocations.nbytes)
    assert after_start == (6, 3 * (1024 + 8 * 10 * 4))
    buffers = {id(s.staging) for s in ring.slots} | {id(s.output) for s in ring.slots}
    seen = set()
    for _ in range(100):
        slot = await ring.acquire()
        slot.staging[:4] = 1  # "use" the slot
        seen.add(slot.index)
        ring.release(slot)
    assert seen == {0, 1, 2}
    assert (ring.allocations.count, ring.allocations.nbytes) == after_start
    assert {id(s.staging) for s in ring.slots} | {id(s.output) for s in ring.slots} == buffers
    assert len(ring) == 3


async def test_release_of_unknown_slot_raises() -> None:
    ring = make_ring(2)
    stranger = fake_slot(9, Allocations())
    with pytest.raises(ValueError, match="does not belong"):
        ring.release(stranger)


async def test_double_release_raises() -> None:
    ring = make_ring(2)
    slot = await ring.acquire()
    ring.release(slot)
    with pytest.raises(ValueError, match="not acquired"):
        ring.release(slot)


async def test_close_fails_waiters_and_later_acquires() -> None:
    ring = make_ring(1)
    await ring.acquire()
    waiter = asyncio.create_task(ring.acquire())
    await asyncio.sleep(0)
    ring.close(EngineDead("device lost"))
    with pytest.raises(EngineDead, match="device lost"):
        await waiter
    with pytest.raises(EngineDead):
        await ring.acquire()


def test_ring_needs_distinct_slots() -> None:
    with pytest.raises(ValueError):
        SlotRing([])
    slot = fake_slot(0, Allocations())
    with pytest.raises(ValueError, match="twice"):
        SlotRing([slot, slot])


def test_pack_images_layout() -> None:
    a = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    b = np.full((1, 2, 3), 200, np.uint8)
    packed = np.zeros(64, np.uint8)
    table = np.full((4, 3), -1, np.int64)
    used = pack_images([a, b], packed, table)
    assert used == a.size + b.size
    assert table[:2].tolist() == [[0, 2, 3], [a.size, 1, 2]]
    assert np.array_equal(packed[: a.size], a.reshape(-1))
    assert np.array_equal(packed[a.size : used], b.reshape(-1))
    with pytest.raises(ValueError, match="staging"):
        pack_images([a, a, a, a], np.zeros(40, np.uint8), table)
    with pytest.raises(ValueError, match="rows"):
        pack_images([b] * 5, packed, table)


def test_slot_layout_accounting_and_validation() -> None:
    f32 = np.dtype(np.float32)
    layout = SlotLayout(
        device=0,
        max_batch_size=4,
        engine_inputs=(TensorDesc("image", f32, (1, 8, 8)),),
        engine_outputs=(TensorDesc("logits", f32, (10,)),),
        results=(
            TensorDesc("topk_indices", np.dtype(np.int64), (3,)),
            TensorDesc("topk_scores", f32, (3,)),
        ),
        copy_back=("topk_indices", "topk_scores"),
        max_input_bytes=1000,
    )
    assert layout.device_bytes == 4 * (256 + 40 + 24 + 12 + 24) + 1000
    assert layout.pinned_bytes == 4 * (24 + 12 + 24) + 1000
    with pytest.raises(ValueError, match="unknown"):
        SlotLayout(0, 4, layout.engine_inputs, layout.engine_outputs, copy_back=("nope",))
    with pytest.raises(ValueError, match="collide"):
        SlotLayout(0, 4, layout.engine_inputs, layout.engine_outputs, results=layout.engine_outputs)


async def test_occupancy_is_reported_on_every_change() -> None:
    """The busy-slot gauge follows acquire and release; a slot handed straight to
    a waiting batch stays busy (no dip that would hide a saturated device)."""
    seen: list[int] = []
    allocations = Allocations()
    ring = SlotRing([fake_slot(i, allocations) for i in range(2)], allocations, seen.append)
    a = await ring.acquire()
    b = await ring.acquire()
    waiting = asyncio.ensure_future(ring.acquire())
    await asyncio.sleep(0)
    ring.release(a)  # handed to the waiter: still 2 busy
    c = await waiting
    ring.release(b)
    ring.release(c)
    assert seen == [0, 1, 2, 1, 0]
