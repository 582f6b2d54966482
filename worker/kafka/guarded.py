"""How the consumer reads the partitions a previous owner died in
(``worker.kafka.crashguard`` decides what each is owed): claimed at their
head when assigned, then read one record at a time (cautious) or with the head
record quarantined, until the guard's window is behind them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from worker.flow.messages import Job, TopicPartition
from worker.kafka.crashguard import CrashGuard, Guarded, Mode, quarantined


class Protection:
    """Crash-loop protection as one consumer applies it to the records it queues."""

    def __init__(
        self,
        guard: CrashGuard,
        max_crashes: int,
        window: int,
        settled: Callable[[TopicPartition], Awaitable[None]],
    ) -> None:
        self.guard = guard
        self._max_crashes = max_crashes
        self._window = window
        self._settled = settled
        # Partitions a previous owner died in, and how they are read meanwhile.
        self._guarded: dict[TopicPartition, Guarded] = {}

    async def claim(self, heads: dict[TopicPartition, int]) -> None:
        """Mark newly assigned partitions at their heads (where reading starts)."""
        claimed = await self.guard.claim_heads(heads, self._max_crashes, self._window)
        self._guarded.update(claimed)

    async def before(self, tp: TopicPartition, offset: int) -> None:
        """Before the record at ``offset`` is queued: a cautious partition waits
        until everything before it is answered and committed."""
        guarded = self._guarded.get(tp)
        if guarded is None or guarded.mode is not Mode.ONE_BY_ONE:
            return
        await self._settled(tp)
        if guarded.armed is not None and offset >= guarded.head:
            # The head record runs next: only now does a death count against it
            # (crashguard.decide).
            await self.guard.claim(tp, guarded.head, guarded.armed)
            guarded.armed = None
        guarded.left -= 1
        if guarded.left <= 0:
            del self._guarded[tp]

    def job(self, job: Job, raw_value: bytes | None) -> Job:
        """``job``, or its quarantine when it is the head record that crashed the
        process ``max_crashes`` times."""
        guarded = self._guarded.get(job.tp)
        if guarded is not None and (guarded.mode, guarded.head) == (Mode.QUARANTINE, job.offset):
            del self._guarded[job.tp]
            return quarantined(job, raw_value, self._max_crashes)
        return job
