"""``SlotWatch.hold``: a slot is busy while a stage thread's work on it (an nvJPEG
decode) runs, released when it returns, and kept busy past a cancelled batch
until the work has returned; a dead device kills the stage."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from worker.compute.gpu.completion import SlotWatch
from worker.compute.gpu.slots import Slot, SlotRing
from worker.flow.errors import EngineDead

closed: list[BaseException] = []


def _watch() -> SlotWatch:
    ring = SimpleNamespace(close=closed.append)  # what a dead device does to the ring
    return SlotWatch(None, cast(SlotRing[Slot], ring), 0.001, 1.0)


def _slot() -> Any:
    return SimpleNamespace(pending=None, index=0)


async def test_the_slot_is_busy_while_the_work_runs_and_free_after() -> None:
    watch, slot = _watch(), _slot()
    work: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    holding = asyncio.create_task(watch.hold(slot, work))
    await asyncio.sleep(0)
    assert slot.pending is not None and slot.pending[0] is work
    work.set_result("decoded")
    assert await holding == "decoded" and slot.pending is None


async def test_a_cancelled_batch_leaves_the_slot_busy_until_the_work_returns() -> None:
    watch, slot = _watch(), _slot()
    work: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    holding = asyncio.create_task(watch.hold(slot, work))
    await asyncio.sleep(0)
    holding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holding
    assert slot.pending is not None and not work.done()  # still busy: the thread runs on
    work.set_result("late")


async def test_a_dead_device_kills_the_stage() -> None:
    watch, slot = _watch(), _slot()
    work: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    work.set_exception(EngineDead("cudaErrorLaunchFailure"))
    with pytest.raises(EngineDead):
        await watch.hold(slot, work)
    assert slot.pending is None and watch.dead is not None and closed[-1] is watch.dead
