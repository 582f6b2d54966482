"""Offset commits that follow acknowledged results, never consumption.

``OffsetTracker`` is a pure data structure: the consume stage registers every
offset it reads; the produce stage marks an offset done once the broker
acknowledged its result (or DLQ record). Batches finish out of order, so the
committable position of a partition is a contiguous watermark: offset k+1 is
committed only when every tracked offset <= k is done.

``Committer`` turns the tracker's watermarks into ``consumer.commit`` calls for
partitions this member still owns.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import structlog
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition as KafkaTP

from . import metrics

log = structlog.get_logger(__name__)


class TopicPartition(NamedTuple):
    topic: str
    partition: int


@dataclass
class _PartitionState:
    epoch: int  # changes whenever the partition is forgotten or reset
    pending: deque[int] = field(default_factory=deque)  # tracked, in read order
    sizes: dict[int, int] = field(default_factory=dict)  # bytes of offsets not yet done
    done: set[int] = field(default_factory=set)  # done but not yet below the watermark
    watermark: int | None = None  # next offset to commit (all below are done)
    committed: int | None = None  # last watermark handed to the broker


class OffsetTracker:
    """Per-partition contiguous watermark of done offsets, plus the record and byte
    counts that backpressure is decided on. No I/O.

    Every tracked offset belongs to an *epoch* of its partition. Revoking a
    partition (``forget``) or its offsets moving backwards (a reset, e.g. the
    broker lost its log) starts a new epoch, so results of older epochs are
    recognised as stale even when their offsets coincide with new ones.
    """

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionState] = {}
        self._epochs = 0
        self._bytes = 0
        self.resets = 0

    def _new_state(self) -> _PartitionState:
        self._epochs += 1
        return _PartitionState(epoch=self._epochs)

    def track(self, tp: TopicPartition, offset: int, nbytes: int = 0) -> int:
        """Register an offset as read; returns its epoch. Offsets of one partition
        arrive ascending; one that does not means the partition was reset."""
        state = self._parts.get(tp)
        if state is None:
            state = self._parts[tp] = self._new_state()
        elif (state.pending and offset <= state.pending[-1]) or (
            state.watermark is not None and offset < state.watermark
        ):
            log.warning(
                "partition_reset",
                partition=f"{tp.topic}:{tp.partition}",
                offset=offset,
                previous=state.pending[-1] if state.pending else None,
            )
            self.resets += 1
            self._drop(tp)
            state = self._parts[tp] = self._new_state()
        state.pending.append(offset)
        state.sizes[offset] = nbytes
        self._bytes += nbytes
        return state.epoch

    def owns(self, tp: TopicPartition, offset: int, epoch: int) -> bool:
        """True while ``offset`` of ``epoch`` is tracked and not done; False once
        its partition was revoked or reset, which makes its result stale."""
        state = self._parts.get(tp)
        return state is not None and state.epoch == epoch and offset in state.sizes

    def done(self, tp: TopicPartition, offset: int, epoch: int) -> None:
        """Mark an offset's result acknowledged (stale epochs are ignored)."""
        state = self._parts.get(tp)
        if state is None or state.epoch != epoch or offset not in state.sizes:
            return
        self._bytes -= state.sizes.pop(offset)
        state.done.add(offset)
        while state.pending and state.pending[0] in state.done:
            first = state.pending.popleft()
            state.done.discard(first)
            state.watermark = first + 1

    def in_flight(self, tp: TopicPartition | None = None) -> int:
        """Offsets read but not yet below the watermark."""
        if tp is not None:
            state = self._parts.get(tp)
            return 0 if state is None else len(state.pending)
        return sum(len(s.pending) for s in self._parts.values())

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of records read whose results are not yet acknowledged."""
        return self._bytes

    def committable(
        self, owned: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """Watermarks that moved since the last commit, restricted to ``owned``."""
        allowed = None if owned is None else set(owned)
        return {
            tp: s.watermark
            for tp, s in self._parts.items()
            if s.watermark is not None
            and s.watermark != s.committed
            and (allowed is None or tp in allowed)
        }

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, offset in offsets.items():
            state = self._parts.get(tp)
            if state is not None:
                state.committed = offset

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop revoked partitions: results still arriving for them are stale."""
        for tp in tps:
            self._drop(tp)

    def _drop(self, tp: TopicPartition) -> None:
        state = self._parts.pop(tp, None)
        if state is not None:
            self._bytes -= sum(state.sizes.values())

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)


class CommitTarget(Protocol):
    """The part of aiokafka's consumer the committer needs."""

    async def commit(self, offsets: dict[Any, int]) -> None: ...

    def assignment(self) -> set[Any]: ...


class Committer:
    """Commits tracker watermarks whenever results are acknowledged.

    Calls coalesce: while one commit is on the wire, further acks only set a flag,
    and the next commit carries every watermark that moved meanwhile.
    """

    def __init__(
        self, tracker: OffsetTracker, consumer: CommitTarget, timeout: float = 30.0
    ) -> None:
        self._tracker = tracker
        self._consumer = consumer
        # aiokafka's commit() retries the coordinator lookup and retriable errors
        # without end while the broker is unreachable: bounded here, or the final
        # commit of Worker.stop() (and a revocation's) never returns.
        self._timeout = timeout
        self._wanted = asyncio.Event()
        self._lock = asyncio.Lock()
        self._stopped = False
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        """Called when offsets were marked done: wakes the commit loop and waiters."""
        self._wanted.set()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def progress(self) -> None:
        """Wait for the next ``notify()`` (used to wait for in-flight work to drain)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    async def run(self) -> None:
        while True:
            await self._wanted.wait()
            if self._stopped:
                # Woken by stop(), which follows the owner's final commit: one more
                # attempt would only add a commit timeout when the broker is down.
                return
            self._wanted.clear()
            await self.commit_now()

    def stop(self) -> None:
        self._stopped = True
        self._wanted.set()

    async def commit_now(self, only: Iterable[TopicPartition] | None = None) -> bool:
        """Commit what is committable for owned partitions; True when nothing failed."""
        async with self._lock:
            owned = {TopicPartition(tp.topic, tp.partition) for tp in self._consumer.assignment()}
            if only is not None:
                owned &= set(only)
            offsets = self._tracker.committable(owned)
            if not offsets:
                return True
            try:
                await asyncio.wait_for(
                    self._consumer.commit(
                        {KafkaTP(tp.topic, tp.partition): off for tp, off in offsets.items()}
                    ),
                    self._timeout,
                )
            # CommitFailed, IllegalGeneration, broker unreachable...: retried later
            except (KafkaError, TimeoutError) as exc:
                metrics.COMMIT_FAILURES.inc()
                log.warning("commit_failed", error=repr(exc), partitions=len(offsets))
                return False
            self._tracker.mark_committed(offsets)
            metrics.COMMITS.inc()
            return True
