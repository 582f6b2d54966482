"""An event loop that runs the urgent lane's callbacks before the rest.

asyncio runs ready callbacks first in, first out. Under a bulk backlog the
worker's loop always has bulk work ready (the consumer taking in a lower lane's
records, the writer encoding a batch's answers: a millisecond or more each),
and an urgent request passes through about ten hand-offs between tasks on its
way in and out: each waited behind the bulk callbacks queued before it, and
the urgent p99 was 3x its p99 with no bulk traffic while the broker's and the
benchmark's share of the same load cost it 1.07x (BENCHMARKS.md, "Priority
lanes: what the urgent lane waits for under a bulk drain").

So a callback whose context carries ``URGENT`` goes ahead of every callback
that does not, behind the urgent ones already waiting (first in, first out
among them), and runs in the loop's current turn. What carries it: the tasks
the urgent lane's own clients create (its fetcher and its producer, started
inside ``urgent()``: their connections' reads, fetch and send routines) and
the consumer's wait on the fetcher (``URGENT_CONTEXT``). The tasks that serve
every lane (the consumer, the batcher, the writer) stay in order: marking one
would put the bulk lane's work ahead too. None of the marked tasks runs
without waiting for I/O, so the rest of the loop's turn still runs.

It relies on two of CPython's private ``BaseEventLoop`` methods (``_call_soon``,
``_add_callback``, present in 3.11 to 3.13) and on ``Handle._context``; a loop
without them (another implementation) falls back to plain order, which is
correct, only slower for the urgent lane (``tests/unit/flow/test_urgency.py``
holds the order on the interpreter CI runs).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, Final, TypeVar

T = TypeVar("T")

URGENT: Final[contextvars.ContextVar[bool]] = contextvars.ContextVar(
    "infer_worker_urgent", default=False
)


def _urgent_context() -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(URGENT.set, True)
    return context


@contextmanager
def urgent() -> Iterator[None]:
    """Tasks created inside run urgent (they copy the current context): wrap the
    start of a client whose internal tasks serve the urgent lane."""
    token = URGENT.set(True)
    try:
        yield
    finally:
        URGENT.reset(token)


def urgent_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task that runs urgent, whatever the context it is created from."""
    return asyncio.get_running_loop().create_task(coro, context=_urgent_context())


def _is_urgent(handle: asyncio.Handle) -> bool:
    context: contextvars.Context | None = getattr(handle, "_context", None)
    return context is not None and context.get(URGENT, False)


class UrgentFirstLoop(asyncio.SelectorEventLoop):
    """``asyncio.SelectorEventLoop`` with urgent callbacks first (module docstring)."""

    def _call_soon(self, callback: Callable[..., Any], args: Any, context: Any) -> Any:
        handle = super()._call_soon(callback, args, context)  # type: ignore[misc]
        self._forward(handle)
        return handle

    def _add_callback(self, handle: asyncio.Handle) -> None:
        super()._add_callback(handle)  # type: ignore[misc]
        self._forward(handle)

    def _forward(self, handle: asyncio.Handle) -> None:
        if threading.get_ident() != self._thread_id:  # type: ignore[attr-defined]
            return  # call_soon_threadsafe: the loop's thread may be taking from _ready
        ready = self._ready  # type: ignore[attr-defined]
        if not ready or ready[-1] is not handle or not _is_urgent(handle):
            return
        ready.pop()
        ahead = 0  # the urgent callbacks already at the front keep their turn
        for waiting in ready:
            if not _is_urgent(waiting):
                break
            ahead += 1
        ready.insert(ahead, handle)


def run_serving(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on an ``UrgentFirstLoop`` (the worker's serving loop)."""
    with asyncio.Runner(loop_factory=UrgentFirstLoop) as runner:
        return runner.run(main)
