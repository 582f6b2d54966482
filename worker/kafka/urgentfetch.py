"""The most urgent lane's partitions, fetched on a connection of their own.

aiokafka keeps one fetch request in flight per broker connection, and sends a
node none while another of its partitions holds records not yet taken
(``prefetch_backoff``). Under a bulk backlog the group consumer's connection
is busy with the lower lanes' fetches: a stage probe found no fetch for the
urgent partitions in flight for a third of the time, and an urgent request
22 ms (p50) and 97-106 ms (p99) from the broker appending it to aiokafka
holding it (BENCHMARKS.md, priority lanes, 2026-11-27).

So, with lanes, a second consumer without a group (``UrgentFetcher``) reads
the most urgent lane's partitions; the group consumer keeps them assigned
(membership, commits, exactly-once's offsets in the transaction) but paused
for good. The consumer hands a partition over once it positioned it (at the
committed offset: ``Consumer.start_at_committed``) and takes everything back
when a revocation begins (aiokafka revokes every partition before any new
assignment). A record this fetcher returns goes through the same checks as the
group consumer's: fetched before a revocation or before its partition was
positioned, it is dropped and read again by the partition's next owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition as KafkaTP

from worker.config import KafkaConfig
from worker.kafka.clients import group_consumer_kwargs
from worker.kafka.readable import Fetched, getmany_readable
from worker.obs import metrics

log = structlog.get_logger(__name__)


def fetcher_kwargs(k: KafkaConfig) -> dict[str, Any]:
    """The group consumer's arguments (connection, security, fetch sizes,
    isolation level, the operator's ``consumer_options``) without the group:
    this consumer is assigned partitions, never joins, never commits."""
    return {**group_consumer_kwargs(k), "group_id": None, "group_instance_id": None}


class UrgentFetcher:
    """A group-less consumer over the partitions handed to it (``take``)."""

    def __init__(self, k: KafkaConfig) -> None:
        self._k = k
        self.client: AIOKafkaConsumer | None = None
        # Whether a partition's lane (and model) is paused now: applied to new partitions.
        self._paused: Callable[[KafkaTP], bool] = lambda tp: False

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(**fetcher_kwargs(self._k))
        try:
            await consumer.start()
        except BaseException:
            await consumer.stop()
            raise
        self.client = consumer

    def holds(self, tp: KafkaTP) -> bool:
        return self.client is not None and tp in self.client.assignment()

    def held(self) -> set[KafkaTP]:
        return set() if self.client is None else set(self.client.assignment())

    async def take(self, positions: Mapping[KafkaTP, int]) -> None:
        """Fetch these partitions from these offsets (their decided positions).
        ``assign`` replaces the whole assignment and forgets the positions of
        partitions kept, so those are sought again where they stood (none are,
        as aiokafka revokes every partition first; a record handed over twice
        that way would be dropped by ``OffsetTracker.redelivered``)."""
        if self.client is None or not positions:
            return
        consumer = self.client
        kept = {
            tp: await consumer.position(tp) for tp in consumer.assignment() if tp not in positions
        }
        consumer.assign([*kept, *positions])
        for tp, offset in {**kept, **positions}.items():
            consumer.seek(tp, offset)
        consumer.pause(*(tp for tp in positions if self._paused(tp)))
        metrics.URGENT_FETCH_PARTITIONS.set(len(consumer.assignment()))
        log.info(
            "urgent_fetcher_took", partitions=sorted(f"{t.topic}:{t.partition}" for t in positions)
        )

    def drop_all(self) -> None:
        """Stop fetching every partition (a revocation began); buffered records
        are discarded with the assignment."""
        if self.client is not None and self.client.assignment():
            self.client.assign([])
            metrics.URGENT_FETCH_PARTITIONS.set(0)

    def pause(self, paused: bool) -> None:
        """Follow the most urgent lane's backpressure (every partition held)."""
        self.follow(lambda tp: paused)

    def follow(self, paused: Callable[[KafkaTP], bool]) -> None:
        """Pause each partition held whose backpressure is paused (``paused``: by
        partition; the most urgent lane's, or with several models that lane's
        of the partition's model), resume the others."""
        self._paused = paused
        if self.client is None:
            return
        held = self.client.assignment()
        self.client.pause(*(tp for tp in held if paused(tp)))
        self.client.resume(*(tp for tp in held if not paused(tp)))

    def highwater(self, tp: KafkaTP) -> int | None:
        return None if self.client is None else self.client.highwater(tp)

    async def getmany(self, timeout_ms: int) -> Fetched:
        """Records fetched (``timeout_ms`` 0: only those already here)."""
        if self.client is None or not self.client.assignment():
            if timeout_ms:
                await asyncio.sleep(timeout_ms / 1000.0)
            return {}
        return await getmany_readable(self.client, timeout_ms)

    async def close(self) -> None:
        consumer, self.client = self.client, None
        if consumer is not None:
            await consumer.stop()


Stamped = tuple[int, Fetched]


class BothSources:
    """Waits on the group consumer and the urgent fetcher at once. Each wait is
    kept until it completes, never cancelled mid-way (``cancel`` only at the
    end): a ``getmany`` cancelled after it took records would lose them, its
    consumer's position being past them. Each result carries the consumer's
    stamp from the step it completed in (``Consumer._enqueue`` drops records
    fetched before a revocation or a positioning)."""

    def __init__(
        self,
        group: Callable[[int], Awaitable[Fetched]],
        fetcher: UrgentFetcher,
        stamp: Callable[[], int],
    ) -> None:
        """``group``: the group consumer's ``getmany`` (by lane) for a timeout."""
        self._group = group
        self._fetcher = fetcher
        self._stamp = stamp
        self._waits: dict[str, asyncio.Future[Stamped]] = {}

    async def next(self, timeout_ms: int) -> list[Stamped]:
        """Whatever either source returned first (both, when both are done): the
        urgent fetcher's records only for partitions it still holds (others are
        from before a revocation), the group consumer's only for partitions the
        fetcher does not hold (it has those paused: a record of one would be
        read twice)."""
        if "urgent" not in self._waits:
            self._waits["urgent"] = asyncio.ensure_future(self._from_fetcher(timeout_ms))
        if "group" not in self._waits:
            self._waits["group"] = asyncio.ensure_future(self._from_group(timeout_ms))
        await asyncio.wait(self._waits.values(), return_when=asyncio.FIRST_COMPLETED)
        return self.done()

    def done(self) -> list[Stamped]:
        """The results of the waits already completed, without waiting (a
        failure raised only when no records came beside it)."""
        got: list[Stamped] = []
        failed: BaseException | None = None
        for name, wait in list(self._waits.items()):
            if not wait.done():
                continue
            del self._waits[name]
            if (exc := wait.exception()) is not None:
                failed = exc
            else:
                got.append(wait.result())
        if failed is not None and not any(fetched for _, fetched in got):
            raise failed
        if failed is not None:  # the records first; the source fails again on its next call
            log.warning("fetch_failed_beside_records", error=repr(failed))
        return got

    async def _from_fetcher(self, timeout_ms: int) -> Stamped:
        fetched = await self._fetcher.getmany(timeout_ms)
        return self._stamp(), {tp: r for tp, r in fetched.items() if self._fetcher.holds(tp)}

    async def _from_group(self, timeout_ms: int) -> Stamped:
        fetched = await self._group(timeout_ms)
        return self._stamp(), {tp: r for tp, r in fetched.items() if not self._fetcher.holds(tp)}

    def cancel(self) -> None:
        """Stop both waits (the consumer stops: what they would return is read
        again by the partitions' next owner, from the committed offsets)."""
        for wait in self._waits.values():
            wait.cancel()
        self._waits.clear()


async def hand_over(
    fetcher: UrgentFetcher | None,
    group: AIOKafkaConsumer,
    urgent: list[KafkaTP],
    still_owned: Callable[[], bool],
) -> set[KafkaTP]:
    """Hand the most urgent lane's newly positioned partitions to ``fetcher`` at
    the group consumer's positions (they stay paused in it); returns those it
    must not resume. Not handed over when a revocation began meanwhile
    (``still_owned`` false: no longer this member's), nor when the hand-over
    fails: the group consumer reads them then, as without the fetcher."""
    if fetcher is None or not urgent:
        return set()
    try:
        positions = {t: await group.position(t) for t in urgent}
        if not still_owned():
            return set(urgent)
        await fetcher.take(positions)
    except KafkaError as exc:
        log.warning("urgent_fetcher_refused", error=repr(exc), partitions=len(urgent))
        return set()
    return set(urgent)
