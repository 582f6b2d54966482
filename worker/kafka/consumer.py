"""Consumer: the group consumer and the bounded queue it fills (its rebalance
listener is ``worker.kafka.listener``).

Every record read is registered with the offset tracker *before* it is queued, so
the commit watermark can never pass a record that has not been answered. Each
record becomes a ``Job`` through the intake (``worker.kafka.intake``), which
never raises: bad records flow on, in order, carrying their failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from aiokafka.structs import TopicPartition as KafkaTP

from worker.config import KafkaConfig
from worker.flow.backoff import Backoff
from worker.flow.lanes import LaneBackpressure
from worker.flow.messages import Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.flow.streams import end_of_streams, first_of
from worker.kafka.clients import group_consumer_kwargs
from worker.kafka.guarded import Protection
from worker.kafka.intake import JobFactory
from worker.kafka.lanefetch import (
    LOWER_LANE_RECORDS,
    fetch_for_lanes,
    fetch_timeout_ms,
    getmany_by_lane,
    lane_of,
)
from worker.kafka.listener import RebalanceListener, RevokeHook, settle
from worker.kafka.pausing import Pausing
from worker.kafka.permissions import NOT_AUTHORISED
from worker.kafka.positions import position_at_committed
from worker.kafka.urgentfetch import BothSources, Stamped, UrgentFetcher, hand_over
from worker.obs import metrics

log = structlog.get_logger(__name__)


def fetch_backoff() -> Backoff:
    """Waits between failed fetches: 0.2 s doubling to 5 s, no jitter (one
    member's own fetch loop; the broker sees its reconnects, not these)."""
    return Backoff(0.2, cap=5.0, jitter=(1.0, 1.0))


class Consumer:
    """Consumes input topics into ``jobs_out`` until ``stop_fetching()``; then
    puts ``None`` (end of stream) so downstream stages drain."""

    def __init__(
        self,
        kafka: KafkaConfig,
        make_job: JobFactory,
        jobs_out: Mapping[str, asyncio.Queue[Job | None]],
        tracker: OffsetTracker,
        on_revoke: RevokeHook,
        backpressure: LaneBackpressure,
        ranks: Mapping[str, int] | None = None,
    ) -> None:
        """``make_job``: the intake, which decides each record's model or pipeline
        (``Job.model``); ``jobs_out``: each one's jobs queue, by name. ``ranks``:
        several models in one worker, each input topic's place in the
        backpressure (its model's); none: the topics' priority lanes."""
        self._kafka = kafka
        self._topics = list(kafka.input_topics)  # and those of models brought since (admit)
        self._pausing = Pausing(kafka, backpressure, tracker, ranks)
        self._make_job = make_job
        self._jobs_of = dict(jobs_out)
        # One model: every job to its one queue, without a look-up per record.
        self._only = next(iter(self._jobs_of.values())) if len(self._jobs_of) == 1 else None
        self._queues = list(self._jobs_of.values())
        self._tracker = tracker
        self._on_revoke = on_revoke
        self._stopping = asyncio.Event()
        # A stamp taken when each fetch returns, and when a revocation began or a
        # partition was positioned: records fetched before either are dropped.
        self._stamp = 0
        self._revoked_at = 0
        self._positioned_at: dict[TopicPartition, int] = {}
        self._positioning: set[KafkaTP] = set()  # paused until positioned
        # The group's committed offset of each partition as it was assigned: its
        # lag's base until this member commits it (``worker.kafka.monitors``).
        self.committed_at_assignment: dict[TopicPartition, int] = {}
        # Crash-loop protection (set by the worker when the guard topic exists).
        self.protection: Protection | None = None
        self.client: AIOKafkaConsumer | None = None
        # With lanes, the most urgent lane's partitions are read by a consumer of
        # their own (``worker.kafka.urgentfetch``), waited on beside this one.
        self._urgent: UrgentFetcher | None = None
        self._sources: BothSources | None = None
        # A stateful model's restore from its state changelog, per assignment.
        self._restore: Callable[[list[TopicPartition]], Awaitable[None]] | None = None
        # While every lane is paused: the next acknowledgement (wake_on); never
        # set until then, when the 50 ms poll alone paces the loop.
        self._progress: Callable[[], Awaitable[object]] = asyncio.Event().wait

    async def start(self) -> None:
        k = self._kafka
        consumer = AIOKafkaConsumer(**group_consumer_kwargs(k))
        consumer.subscribe(self._topics, listener=RebalanceListener(self, self._on_revoke))
        if k.has_lanes:  # started first: the first assignment hands it partitions
            self._urgent = UrgentFetcher(k)
            await self._urgent.start()
            group = lambda t: getmany_by_lane(consumer, k, t, LOWER_LANE_RECORDS)  # noqa: E731
            self._sources = BothSources(group, self._urgent, lambda: self._stamp)
        # Set before start(): the first assignment's listener call may come during it.
        self.client = consumer
        try:
            await consumer.start()
        except BaseException:
            self.client = None
            await consumer.stop()
            await self._close_urgent()
            raise
        apart = self._pausing.apart
        if (k.has_lanes or apart) and not fetch_for_lanes(consumer, k, apart):
            log.warning("lanes_prefetch_unchanged", reason="aiokafka has no _prefetch_backoff")

    async def start_at_committed(self, tps: list[KafkaTP]) -> None:
        """Position newly assigned partitions at the group's committed offset (or
        the beginning when there is none), explicitly, and only then fetch them.
        The consumer can otherwise keep a fetch position from before a
        rebalance, which skips records when the broker lost its log (the
        embedded broker after a restart).

        The partitions are paused before the first await: while the restore of a
        stateful model's states, the committed-offset lookup or the crash guard
        is awaited, aiokafka would fetch them from a position it chose itself,
        and the seek below would have the same records fetched again: answered
        twice, and committed twice under exactly-once (issue 35). Records of a
        fetch made before a partition was positioned are dropped (``_enqueue``);
        they are read again from the decided position once it resumes."""
        assert self.client is not None
        consumer = self.client
        consumer.pause(*tps)
        self._positioning.update(tps)
        revoked_at = self._revoked_at
        try:
            if self._restore is not None and tps:
                await self._restore([TopicPartition(t.topic, t.partition) for t in tps])
            await position_at_committed(self.client, tps, self.committed_at_assignment,
                                        self.protection)  # fmt: skip
        finally:
            self._stamp += 1
            for t in tps:
                self._positioned_at[TopicPartition(t.topic, t.partition)] = self._stamp
            self._positioning.difference_update(tps)
            owned = [t for t in tps if t in consumer.assignment()]
            handed = await hand_over(
                self._urgent, consumer, [t for t in owned if lane_of(self._kafka, t) == 0],
                lambda: self._revoked_at == revoked_at,
            )  # fmt: skip
            # A lane paused by backpressure is resumed by the backpressure.
            still = consumer.assignment()
            paused = self._pausing.paused
            consumer.resume(*(t for t in owned if t in still and t not in handed and not paused(t)))

    def restore_with(self, restore: Callable[[list[TopicPartition]], Awaitable[None]]) -> None:
        """Have each assignment's partitions restored (a stateful model's states)
        before any of their records is queued (before ``start``)."""
        self._restore = restore

    def admit(self, model: str, jobs: asyncio.Queue[Job | None]) -> None:
        """A model the control topic brought: its jobs to ``jobs`` (its topics
        paused by ``pausing``, read once ``subscribe_more`` added them)."""
        if self._stopping.is_set():
            raise RuntimeError("the worker is stopping")
        self._jobs_of[model], self._only = jobs, None
        self._queues.append(jobs)  # ended with the others (end_of_streams)

    @property
    def pausing(self) -> Pausing:
        return self._pausing

    async def subscribe_more(self, topics: Sequence[str]) -> None:
        """Read ``topics`` too: a rebalance. aiokafka drops the assignment the
        moment a subscription changes, and a commit of its partitions then
        fails, so they are settled first, while still assigned (as a
        revocation settles them: in-flight work answered and committed), not
        fetched meanwhile, again while a rebalance came during the settling;
        the group's rebalance then revokes (nothing left) and assigns as any."""
        new = [t for t in topics if t not in self._topics]
        client = self.client
        if client is None:
            self._topics += new
            return  # subscribed to all at start()
        fetch_for_lanes(client, self._kafka, self._pausing.apart)  # (models paused apart now)
        kept: set[KafkaTP] = set()
        try:
            while True:
                held = set(client.assignment())
                client.pause(*held)
                self._positioning.update(held)  # their records dropped, none resumed
                kept |= held
                self.revoking()
                mark = self._stamp  # moved on by a revocation or an assignment meanwhile
                if held:
                    await settle(self._on_revoke, held)
                if self._stamp == mark:
                    break
        finally:
            self._positioning.difference_update(kept)
            self._topics += new
            client.subscribe(self._topics, listener=RebalanceListener(self, self._on_revoke))
            # Its metadata asked for them from now on: the readiness probe checks
            # every input topic against it (watch_broker), which must not find
            # them missing before the group's rejoin asks for them.
            for topic in new:
                client._client.add_topic(topic)

    def stop_fetching(self) -> None:
        self._stopping.set()

    def revoking(self) -> None:
        """Called when a revocation begins: the rest of any fetch made before it is
        dropped, not tracked (see ``_enqueue``)."""
        self._stamp += 1
        self._revoked_at = self._stamp
        if self._urgent is not None:
            self._urgent.drop_all()  # taken back: every partition is revoked first

    async def run(self) -> None:
        assert self.client is not None, "start() first"
        consumer = self.client
        failures = 0
        backoff = fetch_backoff()
        async with end_of_streams(self._queues):
            while not self._stopping.is_set():
                self._apply_backpressure()
                if self._pausing.backpressure.all_paused:
                    # Nothing to fetch: decide again at the next acknowledgement
                    # (or in 50 ms, the poll that keeps the member in the group).
                    await first_of(0.05, self._progress, self._stopping.wait)
                    self._apply_backpressure()
                timeout_ms = fetch_timeout_ms(self._pausing.backpressure)
                fetch = asyncio.ensure_future(self._fetch(consumer, timeout_ms))
                stop = asyncio.ensure_future(self._stopping.wait())
                await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if not fetch.done():
                    # Stopping: records fetched now would only be redelivered later.
                    fetch.cancel()
                    break
                try:
                    got = fetch.result()
                except KafkaError as exc:
                    # The consumer reconnects by itself; back off and poll again.
                    failures += 1
                    metrics.FETCH_ERRORS.inc()
                    log.warning("fetch_failed", error=repr(exc), consecutive=failures)
                    if isinstance(exc, NOT_AUTHORISED):  # an ACL gone: not ready until back
                        metrics.set_condition("fetch", False)
                    await first_of(backoff.next(), self._stopping.wait)  # woken when stopping
                    continue
                if failures:
                    metrics.set_condition("fetch", True)
                failures = 0
                backoff.reset()
                # The urgent lanes' records first: should the queue be full, they
                # are not the ones waiting behind a lower lane's.
                parts = [(tp, records, stamp) for stamp, fetched in got
                         for tp, records in fetched.items()]  # fmt: skip
                for tp, records, stamp in sorted(parts, key=lambda p: lane_of(self._kafka, p[0])):
                    await self._enqueue(tp, records, stamp)
                    self._apply_backpressure()
        if self._sources is not None:
            self._sources.cancel()

    async def _fetch(self, consumer: AIOKafkaConsumer, timeout_ms: int) -> list[Stamped]:
        """``getmany()`` and the stamp at the moment it returned (of the urgent
        fetcher as well, with lanes). Taken in the same step, so it belongs to
        the records: a fetch issued before a revocation waits through the
        rebalance and returns records of the new assignment, which must be
        tracked (the consumer's position is past them)."""
        if self._sources is not None:
            return await self._sources.next(timeout_ms)
        fetched = await getmany_by_lane(consumer, self._kafka, timeout_ms, LOWER_LANE_RECORDS)
        return [(self._stamp, fetched)]

    def wake_on(self, progress: Callable[[], Awaitable[object]]) -> None:
        """While every lane is paused, wait on ``progress`` (the committer's: it
        returns at the next acknowledgement) before deciding again."""
        self._progress = progress

    def _apply_backpressure(self) -> None:
        assert self.client is not None
        self._pausing.apply(self.client, self._positioning, self._urgent)

    async def _enqueue(
        self, ktp: KafkaTP, records: list[ConsumerRecord[Any, Any]], stamp: int
    ) -> None:
        """Queue one partition's records of a fetch, in order. Dropped, not tracked:
        the rest of the fetch once a revocation began since it returned (it waited
        on the full queue); records fetched before their partition was positioned;
        second deliveries of offsets already read (``OffsetTracker.redelivered``)."""
        assert self.client is not None
        tp = TopicPartition(ktp.topic, ktp.partition)
        if ktp in self._positioning or stamp < self._positioned_at.get(tp, 0):
            # Fetched from a position the worker did not decide: the partition is
            # read again from the decided one (start_at_committed).
            return
        # A fetch's offsets ascend: second deliveries can only be its first records.
        highwater = self.highwater(ktp)
        redelivered = 0
        while redelivered < len(records) and self._tracker.redelivered(
            tp, records[redelivered].offset, highwater
        ):
            redelivered += 1
        if redelivered:
            metrics.REDELIVERIES_DROPPED.inc(redelivered)
            log.warning(
                "redelivery_dropped", partition=f"{tp.topic}:{tp.partition}",
                records=redelivered, first=records[0].offset, highwater=highwater,
            )  # fmt: skip
        queued = 0
        try:
            schemas = self._make_job.schemas
            for record in records[redelivered:]:
                if schemas is not None and schemas.unseen(record.value):
                    await schemas.ready(record.value)  # fetched before the record is read
                if self._stopping.is_set():
                    return
                if stamp < self._revoked_at:
                    # A revocation began since these records were fetched, while
                    # this loop waited on the full queue. Tracking the rest now
                    # would give offsets of a revoked, forgotten partition a fresh
                    # epoch that looks owned: answered and committed as a watermark
                    # past offsets never answered in that epoch. Dropping them is
                    # safe: aiokafka revokes every partition before any new
                    # assignment, and each new one starts at the committed offset
                    # (start_at_committed), so whoever owns these offsets next
                    # reads them again.
                    return
                if self.protection is not None:  # a cautious partition: one by one
                    await self.protection.before(tp, record.offset)
                job = self._job(record)
                out = self._only or self._jobs_of[job.model]
                if out.full():
                    await out.put(job)
                else:
                    out.put_nowait(job)  # no coroutine per record while there is room
                queued += 1
        finally:
            # Per fetch, not per record: metric updates are a measurable share of
            # the per-record cost on the consume path.
            metrics.RECORDS_CONSUMED.inc(queued)
            metrics.QUEUE_DEPTH.set(sum(q.qsize() for q in self._queues))

    def _job(self, record: ConsumerRecord[Any, Any]) -> Job:
        """Track the record's offset (before it is queued), then make its Job."""
        resets = self._tracker.resets
        tp = TopicPartition(record.topic, record.partition)
        epoch = self._tracker.track(tp, record.offset, len(record.value or b""))
        if self._tracker.resets != resets:
            metrics.PARTITION_RESETS.inc()
        job = self._make_job(
            record.topic,
            record.partition,
            record.offset,
            record.key,
            record.value,
            record.timestamp,
            record.headers,
            epoch=epoch,
        )
        return job if self.protection is None else self.protection.job(job, record.value)

    @property
    def input_topics(self) -> tuple[str, ...]:
        return tuple(self._topics)

    def highwater(self, ktp: KafkaTP) -> int | None:
        """The end offset the partition's last fetch reported (by the consumer
        that reads it)."""
        assert self.client is not None
        if self._urgent is not None and self._urgent.holds(ktp):
            return self._urgent.highwater(ktp)
        return cast(int | None, self.client.highwater(ktp))

    async def commit(self, offsets: dict[KafkaTP, int]) -> None:
        """Commit explicit offsets (the Committer's only way to reach the group)."""
        assert self.client is not None, "start() first"
        await self.client.commit(offsets)

    def assignment(self) -> set[TopicPartition]:
        if self.client is None:
            return set()
        return {TopicPartition(tp.topic, tp.partition) for tp in self.client.assignment()}

    async def close(self) -> None:
        """Leave the group and close the connection (idempotent)."""
        consumer, self.client = self.client, None
        if consumer is not None:
            await consumer.stop()
        await self._close_urgent()

    async def _close_urgent(self) -> None:
        if self._sources is not None:
            self._sources.cancel()
        fetcher, self._urgent = self._urgent, None
        if fetcher is not None:
            await fetcher.close()
