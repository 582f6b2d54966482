"""Offset commits that follow acknowledged results, never consumption.

``Committer`` turns the tracker's watermarks (``worker.flow.offsets``) into
``consumer.commit`` calls for partitions this member still owns. It is the one
place commits happen: after acks during the run, for revoked partitions during
a rebalance, and once more at shutdown.

Under exactly-once (``transactional=True``) offsets are committed inside the
results' transactions by ``worker.kafka.delivery.exactly_once``, never here: the
committer then only records what those transactions committed (``record``) and
keeps its waiting and revocation roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import structlog
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.deadline import Deadline
from worker.flow.messages import TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.obs import metrics

log = structlog.get_logger(__name__)


# The least a revocation's commit is given, however the settling spent the budget.
_COMMIT_FLOOR_S = 5.0


class CommitTarget(Protocol):
    """The part of aiokafka's consumer the committer needs."""

    async def commit(self, offsets: dict[Any, int]) -> None: ...

    def assignment(self) -> set[Any]: ...


class Committer:
    """Commits tracker watermarks after results are acknowledged.

    Calls coalesce: while one commit is on the wire, or until ``interval``
    seconds have passed since the last one began, further acks only set a flag,
    and the next commit carries every watermark that moved meanwhile. Commits
    asked for by name (``commit_now``: revocation, shutdown, the crash guard)
    never wait for the interval.
    """

    def __init__(
        self,
        tracker: OffsetTracker,
        consumer: CommitTarget,
        timeout: float = 30.0,
        transactional: bool = False,
        interval: float = 0.0,
    ) -> None:
        self._tracker = tracker
        self._interval = interval
        self._began = float("-inf")  # when the loop's last commit began (monotonic)
        self._consumer = consumer
        self._transactional = transactional
        # aiokafka's commit() retries the coordinator lookup and retriable errors
        # without end while the broker is unreachable: bounded here, or the final
        # commit of Worker.stop() (and a revocation's) never returns.
        self._timeout = timeout
        self._wanted = asyncio.Event()
        self._lock = asyncio.Lock()
        self._stopped = False
        self._waiters: list[asyncio.Future[None]] = []
        # When each partition was last committed (monotonic), for the age gauge.
        self.last_commit: dict[TopicPartition, float] = {}
        self.last_offsets: dict[TopicPartition, int] = {}  # what this member committed last

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
            wait = self._began + self._interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # acks meanwhile join this commit
            self._wanted.clear()
            self._began = time.monotonic()
            await self.commit_now()

    def stop(self) -> None:
        self._stopped = True
        self._wanted.set()

    async def commit_now(
        self, only: Iterable[TopicPartition] | None = None, timeout: float | None = None
    ) -> bool:
        """Commit what is committable for owned partitions; True when nothing failed."""
        if self._transactional:
            return True  # committed with the results, in their transactions
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
                    self._timeout if timeout is None else min(timeout, self._timeout),
                )
            # CommitFailed, IllegalGeneration, broker unreachable...: retried later
            except (KafkaError, TimeoutError) as exc:
                metrics.COMMIT_FAILURES.inc()
                log.warning("commit_failed", error=repr(exc), partitions=len(offsets))
                return False
            self.record(offsets)
            return True

    def record(self, offsets: dict[TopicPartition, int]) -> None:
        """``offsets`` are committed (here, or by a transaction under exactly-once)."""
        self._tracker.mark_committed(offsets)
        now = time.monotonic()
        for tp, offset in offsets.items():
            self.last_commit[tp] = now
            self.last_offsets[tp] = offset
        metrics.COMMITS.inc()

    async def settle_revoked(
        self,
        revoked: set[TopicPartition],
        budget: Deadline,
        failed: Callable[[], bool],
        fence: Callable[[set[TopicPartition]], Awaitable[None]] | None = None,
    ) -> int:
        """On revocation: let in-flight work of ``revoked`` finish (while
        ``budget`` lasts, or until ``failed()``), commit it, and forget the
        partitions so late results are recognised as stale. ``fence``
        (exactly-once) runs just before they are forgotten: no answer of theirs
        may stay in an open transaction past the hand-over. One budget for the
        whole hand-over: the commit gets what the settling left, but at least a
        few seconds (it must still be tried: what it fails to commit the next
        owner answers again). Returns how many offsets were fenced (left
        uncommitted for the next owner)."""
        while any(self._tracker.in_flight(tp) for tp in revoked):
            if budget.expired or failed():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress(), budget.left())
        await self.commit_now(only=revoked, timeout=budget.left(floor=_COMMIT_FLOOR_S))
        fenced = sum(self._tracker.in_flight(tp) for tp in revoked)
        metrics.REVOKE_FENCED.inc(fenced)
        if fence is not None:
            await fence(revoked)
        self._tracker.forget(revoked)
        return fenced

    async def settled(self, tp: TopicPartition) -> None:
        """Until every record of ``tp`` read so far is answered and committed (the
        crash guard's cautious mode reads the next record only then)."""
        while self._tracker.in_flight(tp) and not self._stopped:
            await self.progress()
        await self.commit_now(only={tp})
