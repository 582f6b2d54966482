"""The queues between stages: their end of stream, and waiting on one.

Stages are linked by bounded queues and signal the end of their output with
``None``, so shutdown drains stage by stage. How that ``None`` is put depends on
why the stage ends, and getting it wrong hangs ``Worker.stop()``; so it lives here,
once, for every stage. ``next_or_woken`` waits for a queue's next item or for
something else, whichever comes first, without ever losing an item;
``first_of`` waits for the first of several things, at most a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")


class Woken(enum.Enum):
    """What ``next_or_woken`` returns when woken, not by an item."""

    WOKEN = "woken"


async def next_or_woken(
    queue: asyncio.Queue[Item], wake: Callable[[], Awaitable[object]]
) -> Item | Woken:
    """The queue's next item, or ``WOKEN`` as soon as ``wake()`` completes first.
    No item is ever taken and dropped, even when the caller is cancelled:
    ``Queue.get`` removes an item only after its wait returns, never when
    cancelled, and the read is cancelled on every way out."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    woken = asyncio.ensure_future(wake())
    try:
        await asyncio.wait({getter, woken}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    return Woken.WOKEN


async def first_of(timeout: float, *waits: Callable[[], Awaitable[object]]) -> None:
    """Until the first of ``waits()`` completes, or ``timeout`` seconds passed;
    the others are cancelled (and all of them if the caller is)."""
    tasks = {asyncio.ensure_future(wait()) for wait in waits}
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


@contextlib.asynccontextmanager
async def end_of_stream(queue: asyncio.Queue[Any]) -> AsyncIterator[None]:
    """Put ``None`` into ``queue`` when the block ends.

    Normal end or a failure: wait for room, so downstream drains everything.
    Cancelled (drain deadline passed, second signal): downstream is being
    cancelled too or is stuck, so only put it if there is room right now; a
    blocking put into a full queue would never return.
    """
    try:
        yield
    except asyncio.CancelledError:
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(None)
        raise
    except BaseException:
        await queue.put(None)
        raise
    await queue.put(None)


@contextlib.asynccontextmanager
async def end_of_streams(queues: Sequence[asyncio.Queue[Any]]) -> AsyncIterator[None]:
    """``end_of_stream`` for each of ``queues`` (one producer feeding several),
    those in the sequence when the block ends: a queue added while it ran (a
    model the control topic brought) ends too."""
    try:
        yield
    except asyncio.CancelledError:
        for queue in queues:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
        raise
    except BaseException:
        for queue in queues:
            await queue.put(None)
        raise
    for queue in queues:
        await queue.put(None)


class Merge(Generic[Item]):
    """Futures from several queues into one, each source's in its own order, a
    future passed on once it is done: a slow source never holds a fast one's
    results back (several models' completed batches into one writer). One
    ``None`` goes out once every source has ended; a source may be added while
    it runs (``add``: a model the control topic brought)."""

    def __init__(
        self,
        sources: Sequence[asyncio.Queue[asyncio.Future[Item] | None]],
        out: asyncio.Queue[asyncio.Future[Item] | None],
    ) -> None:
        self._out = out
        self._waiting = list(sources)  # added, not forwarded yet
        self._added = asyncio.Event()

    def add(self, source: asyncio.Queue[asyncio.Future[Item] | None]) -> None:
        self._waiting.append(source)
        self._added.set()

    async def _forward(self, source: asyncio.Queue[asyncio.Future[Item] | None]) -> None:
        while (fut := await source.get()) is not None:
            await asyncio.wait({fut})
            await self._out.put(fut)

    async def run(self) -> None:
        running: set[asyncio.Task[None]] = set()
        try:
            async with end_of_stream(self._out):
                while True:
                    while self._waiting:
                        running.add(asyncio.create_task(self._forward(self._waiting.pop(0))))
                    if not running:
                        return
                    self._added.clear()
                    added = asyncio.create_task(self._added.wait())
                    try:
                        done, _ = await asyncio.wait(
                            {*running, added}, return_when=asyncio.FIRST_COMPLETED
                        )
                    finally:
                        added.cancel()
                    for task in done - {added}:
                        running.discard(task)
                        task.result()  # a forwarder's failure is the merge's
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


async def merge_done(
    sources: Sequence[asyncio.Queue[asyncio.Future[Item] | None]],
    out: asyncio.Queue[asyncio.Future[Item] | None],
) -> None:
    """``Merge(sources, out).run()``: the sources fixed."""
    await Merge(sources, out).run()
