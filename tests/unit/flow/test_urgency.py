"""The urgent-first event loop: urgent callbacks ahead of the rest, first in,
first out among themselves; the rest in order; other threads' calls untouched."""

from __future__ import annotations

import asyncio
import contextvars
import threading

from worker.flow.urgency import URGENT, UrgentFirstLoop, run_serving, urgent, urgent_task


def _urgent_context() -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(URGENT.set, True)
    return context


def _run(setup: object) -> None:
    loop = UrgentFirstLoop()
    try:
        loop.call_soon(setup, loop)  # type: ignore[arg-type]
        loop.run_until_complete(asyncio.sleep(0.05))
    finally:
        loop.close()


def test_urgent_callbacks_run_before_earlier_ones_in_their_own_order() -> None:
    order: list[str] = []

    def setup(loop: asyncio.AbstractEventLoop) -> None:
        ctx = _urgent_context()
        loop.call_soon(order.append, "a")
        loop.call_soon(order.append, "u1", context=ctx)
        loop.call_soon(order.append, "b")
        loop.call_soon(order.append, "u2", context=ctx)
        loop.call_soon(order.append, "c")

    _run(setup)
    assert order == ["u1", "u2", "a", "b", "c"]


def test_a_plain_loop_would_keep_arrival_order() -> None:
    """The reference: the same calls on asyncio's own loop (the test above fails there)."""
    order: list[str] = []
    loop = asyncio.SelectorEventLoop()
    try:
        ctx = _urgent_context()
        loop.call_soon(order.append, "a")
        loop.call_soon(order.append, "u1", context=ctx)
        loop.call_soon(order.append, "b")
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert order == ["a", "u1", "b"]


def test_an_urgent_task_wakes_ahead_of_a_busy_one() -> None:
    """A task created inside ``urgent()`` (as the urgent lane's clients start) or
    by ``urgent_task`` steps ahead of a task that yields after every step."""
    order: list[str] = []

    async def steps(name: str, n: int) -> None:
        for i in range(n):
            order.append(f"{name}{i}")
            await asyncio.sleep(0)

    async def main() -> None:
        bulk = asyncio.create_task(steps("b", 4))
        await asyncio.sleep(0)  # the bulk task is under way
        with urgent():
            inherited = asyncio.create_task(steps("u", 2))
        made = urgent_task(steps("w", 2))
        await asyncio.gather(bulk, inherited, made)

    order.clear()
    assert run_serving(main()) is None
    first_bulk_after = order.index("b1")
    assert {"u0", "u1", "w0", "w1"} <= set(order[:first_bulk_after])
    assert order.index("u0") < order.index("u1") and order.index("w0") < order.index("w1")
    assert [o for o in order if o.startswith("b")] == ["b0", "b1", "b2", "b3"]


def test_calls_from_another_thread_keep_their_place() -> None:
    """``call_soon_threadsafe`` (the inference thread's completions) is not moved:
    the loop's thread may be taking from the ready queue at that moment."""
    order: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ctx = _urgent_context()
        done = threading.Event()

        def other_thread() -> None:
            loop.call_soon_threadsafe(order.append, "t", context=ctx)
            done.set()

        loop.call_soon(order.append, "a")
        threading.Thread(target=other_thread).start()
        await asyncio.to_thread(done.wait)
        await asyncio.sleep(0.01)

    run_serving(main())
    assert sorted(order) == ["a", "t"]


def test_run_serving_runs_on_the_urgent_first_loop() -> None:
    async def main() -> type:
        return type(asyncio.get_running_loop())

    assert run_serving(main()) is UrgentFirstLoop
