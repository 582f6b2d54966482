"""Deadline-bounded micro-batching: pure asyncio, no Kafka, no GPU.

``BatchPolicy`` holds the forming batch and decides, for a given monotonic time,
whether a flush rule fires; it does no I/O, so every rule is unit-tested with an
injected clock. ``MicroBatcher`` is the thin async stage that feeds it from the
consume queue and hands finished batches downstream.

Flush rules, first match wins:

1. the batch holds ``max_batch_size`` requests;
2. after draining everything already queued, the batch holds one of the
   ``preferred_batch_sizes`` (it is sent as it is; waiting could not
   make the engine more efficient, only the request later);
3. the oldest request has waited ``max_queue_delay``;
4. some request's deadline minus the expected service time has come, so waiting
   any longer would make it miss its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol

from worker.flow.messages import Batch, FlushReason, T
from worker.flow.room import Room
from worker.flow.streams import Woken, next_or_woken
from worker.flow.throttle import Throttle

Clock = Callable[[], float]


def ewma(current: float, sample: float, alpha: float) -> float:
    """The service-time estimate after ``sample`` (the first sample as it is)."""
    return sample if current == 0.0 else (1 - alpha) * current + alpha * sample


class Policy(Protocol[T]):
    """What the batcher asks of a policy: ``BatchPolicy`` (one lane, FIFO) or
    ``worker.flow.lanes.LanePolicy`` (priority lanes)."""

    @property
    def has_room(self) -> bool: ...

    def add(self, item: T) -> None: ...

    def next_flush_at(self) -> float | None: ...

    def take(self, now: float, *, queue_drained: bool) -> Batch[T] | None: ...

    def drain(self, now: float) -> Batch[T] | None: ...

    def observe_service_time(self, seconds: float, alpha: float = 0.2) -> None: ...


@dataclass
class BatchPolicy(Generic[T]):
    max_batch_size: int
    max_queue_delay: float  # seconds
    preferred_sizes: tuple[int, ...] = ()
    # EWMA of how long a batch takes from dispatch to result; deadlines flush this early.
    service_time: float = 0.0
    # Called with each batch cut (a lane's metrics, where the one lane is a
    # configured one: a lane served by a process of its own).
    observe: Callable[[Batch[T]], None] | None = None
    # A lane's rate cap (``[[kafka.lanes]] max_records_per_s``, a lane served by
    # a process of its own): a batch waits until the cap allows all its rows.
    throttle: Throttle | None = None
    _pending: list[T] = field(default_factory=list)
    _seq: int = 0

    def __post_init__(self) -> None:
        self.preferred_sizes = tuple(
            sorted(s for s in set(self.preferred_sizes) if s <= self.max_batch_size)
        )

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def has_room(self) -> bool:
        return len(self._pending) < self.max_batch_size

    def add(self, item: T) -> None:
        self._pending.append(item)

    def observe_service_time(self, seconds: float, alpha: float = 0.2) -> None:
        self.service_time = ewma(self.service_time, seconds, alpha)

    def next_flush_at(self) -> float | None:
        """The monotonic time at which rule 3 or 4 fires, or None when empty."""
        if not self._pending:
            return None
        at = self._pending[0].arrived + self.max_queue_delay
        for item in self._pending:
            if item.deadline is not None:
                at = min(at, item.deadline - self.service_time)
        if self.throttle is not None:
            at = max(at, self.throttle.ready_at(min(len(self._pending), self.max_batch_size)))
        return at

    def take(self, now: float, *, queue_drained: bool) -> Batch[T] | None:
        """Return a batch if a flush rule fires at ``now``, else None."""
        n = len(self._pending)
        if n == 0:
            return None
        if self.throttle is not None and self.throttle.available(now) < min(n, self.max_batch_size):
            return None  # held to the lane's rate: cut once the cap allows every row
        if n >= self.max_batch_size:
            return self._cut(self.max_batch_size, now, "full")
        if queue_drained and self.preferred_sizes:
            fitting = [s for s in self.preferred_sizes if s <= n]
            if fitting and fitting[-1] == n:
                return self._cut(n, now, "preferred")
        flush_at = self.next_flush_at()
        assert flush_at is not None
        if now >= flush_at:
            delay_due = now >= self._pending[0].arrived + self.max_queue_delay
            return self._cut(n, now, "delay" if delay_due else "deadline")
        return None

    def drain(self, now: float) -> Batch[T] | None:
        """Everything pending as one last batch (shutdown)."""
        if not self._pending:
            return None
        return self._cut(len(self._pending), now, "drain")

    def _cut(self, n: int, now: float, reason: FlushReason) -> Batch[T]:
        items, self._pending = self._pending[:n], self._pending[n:]
        if self.throttle is not None:
            self.throttle.take(n, now)
        self._seq += 1
        batch = Batch(items=items, formed_at=now, reason=reason, seq=self._seq)
        if self.observe is not None:
            self.observe(batch)
        return batch


class MicroBatcher(Generic[T]):
    """Async stage: consume-queue items in, ``Batch`` objects out.

    ``None`` on the input queue means end of stream: the forming batch is flushed
    and ``None`` is passed on, so shutdown drains stage by stage. With a ``room``
    (``worker.flow.room``), a due batch is cut only when the engine can start
    it; meanwhile the queue is still read into the policy, so what arrives while
    the engine is busy is there when the batch is formed. Without one (tests,
    tools), a batch is cut as soon as it is due.
    """

    def __init__(
        self,
        items_in: asyncio.Queue[T | None],
        batches_out: asyncio.Queue[Batch[T] | None],
        policy: Policy[T],
        clock: Clock = time.monotonic,
        room: Room | None = None,
    ) -> None:
        self._items_in = items_in
        self._batches_out = batches_out
        self.policy = policy
        self._clock = clock
        self._room = room

    async def run(self) -> None:
        policy = self.policy
        ended = False
        while not ended:
            ended = await self._next()
            while (
                not ended
                and self._room_free()
                and (batch := policy.take(self._clock(), queue_drained=self._items_in.empty()))
                is not None
            ):
                await self._put(batch)
                # What arrived while the put waited joins before the next cut: with
                # priority lanes an urgent request must not wait in the queue
                # behind the backlog the policy already holds.
                ended = self._drain_ready()
        while (batch := policy.take(self._clock(), queue_drained=False)) is not None:
            await self._put(batch)
        if (last := policy.drain(self._clock())) is not None:
            await self._put(last)
        await self._batches_out.put(None)

    def _room_free(self) -> bool:
        return self._room is None or self._room.free

    async def _put(self, batch: Batch[T]) -> None:
        if self._room is not None:
            await self._room.wait()  # at end of stream; otherwise free already
            self._room.take()
        await self._batches_out.put(batch)

    async def _next(self) -> bool:
        """Wait for an item, for the policy's next flush time, or (the engine
        busy) for room; an item joins the policy with everything queued behind
        it. True on end of stream."""
        policy = self.policy
        if self._room_free():
            flush_at = policy.next_flush_at()
            timeout = None if flush_at is None else max(0.0, flush_at - self._clock())
            try:
                item = await asyncio.wait_for(self._items_in.get(), timeout)
            except TimeoutError:
                return False
        else:
            assert self._room is not None
            if not policy.has_room:
                await self._room.wait()
                return False
            # Room freed first: no item taken (``next_or_woken`` drops none).
            got = await next_or_woken(self._items_in, self._room.wait)
            if got is Woken.WOKEN:
                return False
            item = got
        if item is None:
            return True
        policy.add(item)
        return self._drain_ready()

    def _drain_ready(self) -> bool:
        """Move already-queued items into the policy without waiting; True on EOS."""
        while self.policy.has_room:
            try:
                item = self._items_in.get_nowait()
            except asyncio.QueueEmpty:
                return False
            if item is None:
                return True
            self.policy.add(item)
        return False
