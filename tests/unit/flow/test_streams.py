"""Queues between stages: several models' completed batches merged for one writer."""

from __future__ import annotations

import asyncio

from worker.flow.streams import merge_done

Futures = asyncio.Queue[asyncio.Future[str] | None]


async def test_a_slow_source_does_not_hold_a_fast_ones_results_back() -> None:
    slow: Futures = asyncio.Queue()
    fast: Futures = asyncio.Queue()
    out: Futures = asyncio.Queue()
    loop = asyncio.get_running_loop()
    held = loop.create_future()  # model A's batch, still on its engine
    slow.put_nowait(held)
    firsts = [loop.create_future() for _ in range(3)]  # model B's, done at once
    for i, fut in enumerate(firsts):
        fut.set_result(f"b{i}")
        fast.put_nowait(fut)
    merging = asyncio.create_task(merge_done([slow, fast], out))
    got = [(await asyncio.wait_for(out.get(), 1.0)) for _ in range(3)]
    assert [f.result() for f in got if f is not None] == ["b0", "b1", "b2"]
    assert out.empty()  # A's batch is not passed on before it is done
    held.set_result("a0")
    first = await asyncio.wait_for(out.get(), 1.0)
    assert first is not None and first.result() == "a0"
    slow.put_nowait(None)
    assert not merging.done()  # one source still open: no end of stream yet
    fast.put_nowait(None)
    assert await asyncio.wait_for(out.get(), 1.0) is None  # then one end for all
    await merging


async def test_each_sources_order_is_kept() -> None:
    src: Futures = asyncio.Queue()
    out: Futures = asyncio.Queue()
    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in range(3)]
    for fut in futs:
        src.put_nowait(fut)
    src.put_nowait(None)
    merging = asyncio.create_task(merge_done([src], out))
    futs[2].set_result("2")
    futs[1].set_result("1")
    await asyncio.sleep(0)
    assert out.empty()  # the first is not done: nothing after it goes ahead of it
    futs[0].set_result("0")
    seen = [await asyncio.wait_for(out.get(), 1.0) for _ in range(4)]
    assert [f.result() if f is not None else None for f in seen] == ["0", "1", "2", None]
    await merging
