"""ResultSink: encode answers, produce results / DLQ records, await broker acks.

Completed batches arrive in dispatch order and are sent in that order, so results
of one input partition are produced in request order. Acks are awaited in a
background task per batch (bounded), so the next batch's sends overlap the
previous batch's acknowledgement; only acknowledged offsets are marked done in
the tracker, which is what lets the committer move the watermark.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnknownProducerId,
)
from aiokafka.partitioner import DefaultPartitioner

from worker import metrics
from worker.config import KafkaConfig
from worker.contract import ModelInfo
from worker.errors import DeliveryFailed, FailureBudgetExceeded
from worker.logs import RateLimited
from worker.pipeline.budget import FailureBudget
from worker.pipeline.commit import Committer
from worker.pipeline.kafka import start_producer
from worker.pipeline.offsets import OffsetTracker
from worker.pipeline.outgoing import FallbackCode, Outgoing, Topics, fallback, outgoing
from worker.records import Completed

log = structlog.get_logger(__name__)

# Broker and client refusals that mean "this record is too large": the fallback
# is then a ``too_large`` answer; any other permanent refusal is ``internal``.
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)
# What an idempotent producer's broken sequence looks like. aiokafka numbers a
# partition's record batches as it sends them and never renumbers: once the
# broker refuses one for good (too large, say), it refuses every later batch of
# that partition as out of order. Those records were never written; they are
# re-sent through a new producer (new producer id, sequences from 0).
_SEQUENCE_BROKEN = (OutOfOrderSequenceNumber, UnknownProducerId)


def retriable(exc: BaseException) -> bool:
    """Whether sending the same record again can succeed. aiokafka raises
    ``KafkaTimeoutError`` (which does not call itself retriable) when a record
    could not even be queued within ``request_timeout_ms``, because its
    partition's pending batch was not drained: the partition's leader is gone
    (measured: SIGKILL of a partition leader of a three-broker cluster). The
    record was never written and took no sequence number: it is re-sent as it
    is, not replaced by a fallback as a refusal for good would be."""
    return isinstance(exc, KafkaTimeoutError) or bool(getattr(exc, "retriable", True))


ProducerFactory = Callable[[KafkaConfig], Awaitable[tuple[AIOKafkaProducer, bool]]]


def refusal_code(exc: BaseException) -> FallbackCode:
    """Translate a permanent delivery failure into the fallback's error code."""
    return "too_large" if isinstance(exc, _TOO_LARGE) else "internal"


class ResultSink:
    """Produces answers in order, awaits acks, marks offsets done.

    When acknowledgements fail (broker unreachable, timeouts), nothing is marked
    done for those records; the sink stops taking new batches, reports not-ready,
    and re-sends the unacknowledged records with exponential backoff until the
    broker takes them. Upstream queues then fill and backpressure pauses fetching,
    so memory stays bounded however long the outage lasts.
    """

    def __init__(
        self,
        source: asyncio.Queue[asyncio.Future[Completed] | None],
        kafka: KafkaConfig,
        model: ModelInfo,
        tracker: OffsetTracker,
        committer: Committer,
        max_pending_acks: int,
        budget: FailureBudget | None = None,
        producer_factory: ProducerFactory = start_producer,
    ) -> None:
        self._source = source
        self._kafka = kafka
        self._model = model
        self._metrics = metrics.ModelMetrics(model.name, model.version)
        self._tracker = tracker
        self._committer = committer
        self._budget = budget
        self._ack_slots = asyncio.Semaphore(max_pending_acks)
        self._ack_tasks: set[asyncio.Task[None]] = set()
        self._undelivered: list[Outgoing] = []
        self._delivery_failed = asyncio.Event()  # set when an ack fails
        self._seq = 0
        self._rejections = RateLimited(burst=10, interval=10.0)
        self._partitioner = DefaultPartitioner()
        self._topics = Topics(output=kafka.output_topic, dlq=kafka.dlq_topic)
        self._producer_factory = producer_factory
        self._renew = False  # an idempotent producer's sequence may be broken
        self.producer: AIOKafkaProducer | None = None
        self.idempotent = False

    async def start(self) -> None:
        self.producer, self.idempotent = await self._producer_factory(self._kafka)
        log.info("producer_started", idempotent=self.idempotent)

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> Any:
        """One record through the current producer, acknowledged (for the crash
        guard's marks: the producer may be replaced, see ``_renew_producer``)."""
        assert self.producer is not None, "start() first"
        return await self.producer.send_and_wait(topic, value, key=key)

    async def existing_topics(self) -> set[str]:
        """Topics the cluster has, from one metadata request for all topics (which,
        unlike a request naming a topic, never auto-creates one)."""
        assert self.producer is not None, "start() first"
        cluster = await self.producer.client.fetch_all_metadata()
        return set(cluster.topics())

    async def run(self) -> None:
        while (fut := await self._next()) is not None:
            completed = await fut  # EngineDead propagates: the worker stops, uncommitted
            metrics.INFLIGHT_BATCHES.dec()
            await self._send_batch(completed)
        await self._settle()
        if self._undelivered:
            await self._redeliver()

    async def _next(self) -> asyncio.Future[Completed] | None:
        """The next completed batch; records whose acks fail meanwhile are re-sent
        while waiting for it. Redelivering only when a batch arrives left the last
        failed records of a burst pending for good: while fetching is paused
        because they are in flight, no batch ever comes (a deadlock), and on an
        idle topic their clients wait for unrelated traffic."""
        while True:
            self._delivery_failed.clear()
            if self._undelivered:
                await self._redeliver()
            if not self._source.empty():
                return self._source.get_nowait()
            getter = asyncio.ensure_future(self._source.get())
            failed = asyncio.ensure_future(self._delivery_failed.wait())
            try:
                await asyncio.wait({getter, failed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                failed.cancel()
                if not getter.done():
                    # Leaves an item it was woken for in the queue: Queue.get()
                    # removes it only after its wait returns, never when cancelled.
                    getter.cancel()
            if getter.done() and not getter.cancelled():
                return getter.result()

    async def _send_batch(self, completed: Completed) -> None:
        now = time.monotonic()
        outs: list[Outgoing] = []
        for answer in completed.answers:
            job = answer.job
            if not self._tracker.owns(job.tp, job.offset, job.epoch):
                continue  # partition revoked or reset meanwhile: its new owner answers it
            self._seq += 1
            out = outgoing(
                answer, self._model, self._topics, self._seq, now, self._kafka.max_request_size
            )
            if self._budget is not None:
                failed = out.kind == "dlq" or (
                    answer.error is not None and answer.error.code == "inference_failed"
                )
                reason = self._budget.record(failed)
                if reason is not None:
                    raise FailureBudgetExceeded(
                        f"halting: {reason}; last at {job.tp.topic}:{job.tp.partition}@{job.offset}"
                    )
            if out.kind != "ok":
                self._log_rejection(out)
            outs.append(out)
        if not outs:
            return
        sent = await self._send_grouped(outs)
        await self._ack_slots.acquire()
        task = asyncio.create_task(self._await_acks(sent))
        self._ack_tasks.add(task)
        task.add_done_callback(self._ack_tasks.discard)

    def _log_rejection(self, out: Outgoing) -> None:
        """Every request answered with an error or sent to the DLQ is logged (at
        most ``burst`` lines per interval): code, where it came from and its id,
        never its payload."""
        job = out.job
        error = out.error
        code, message = (error.code, error.message) if error is not None else ("?", "")
        self._rejections(
            log.warning,
            "request_rejected",
            code=code,
            message=message[:200],
            topic=job.tp.topic,
            partition=job.tp.partition,
            offset=job.offset,
            id=out.request_id,
            sent_to="dlq" if out.kind == "dlq" else "result",
        )

    async def _send_grouped(
        self, outs: list[Outgoing]
    ) -> list[tuple[Outgoing, asyncio.Future[object]]]:
        """Hand a completed batch's records to the producer as one record batch
        per output partition, instead of one ``send()`` per record: the per-record
        cost of the producer's send path was the largest single share of the
        produce stage. Partitions are chosen exactly as ``send()`` would (the
        default partitioner: murmur2 of the key), and each record's future is its
        batch's, so acknowledgement and redelivery work per record as before."""
        assert self.producer is not None, "start() first"
        by_partition: dict[tuple[str, int], list[Outgoing]] = {}
        partitions: dict[str, list[int]] = {}
        for out in outs:
            parts = partitions.get(out.topic)
            if parts is None:
                try:
                    parts = partitions[out.topic] = sorted(
                        await self.producer.partitions_for(out.topic)
                    )
                except KafkaError:
                    return [(o, await self._send(o)) for o in outs]  # send() reports it
            partition = self._partitioner(out.key, parts, parts)
            by_partition.setdefault((out.topic, partition), []).append(out)
        sent: list[tuple[Outgoing, asyncio.Future[object]]] = []
        for (topic, partition), group in by_partition.items():
            batch, members = self.producer.create_batch(), []
            for out in group:
                if batch.append(key=out.key, value=out.value, timestamp=None, headers=out.headers):
                    members.append(out)
                    continue
                if members:  # full: send it, start the next with this record
                    sent += await self._submit(batch, topic, partition, members)
                    batch, members = self.producer.create_batch(), []
                    if batch.append(
                        key=out.key, value=out.value, timestamp=None, headers=out.headers
                    ):
                        members.append(out)
                        continue
                sent.append((out, await self._send(out)))  # larger than a batch on its own
            if members:
                sent += await self._submit(batch, topic, partition, members)
        return sent

    async def _submit(
        self, batch: Any, topic: str, partition: int, members: list[Outgoing]
    ) -> list[tuple[Outgoing, asyncio.Future[object]]]:
        assert self.producer is not None
        batch.close()
        try:
            fut: asyncio.Future[object] = await self.producer.send_batch(
                batch, topic, partition=partition
            )
        except KafkaError as exc:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
        return [(out, fut) for out in members]

    async def _send(self, out: Outgoing) -> asyncio.Future[object]:
        """Hand one record to the producer; a failure to even enqueue it becomes a
        failed future, handled like a failed ack."""
        assert self.producer is not None, "start() first"
        try:
            fut: asyncio.Future[object] = await self.producer.send(
                out.topic, value=out.value, key=out.key, headers=out.headers
            )
        except KafkaError as exc:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
        return fut

    async def _await_acks(self, sent: list[tuple[Outgoing, asyncio.Future[object]]]) -> None:
        acked: list[Outgoing] = []
        try:
            # One by one, not gather(): a batch's acks arrive together, so after the
            # first wait the rest are already done and awaiting them costs nothing.
            for out, ack in sent:
                try:
                    await ack
                except asyncio.CancelledError as exc:
                    if not ack.cancelled():
                        raise  # this task was cancelled, not the send
                    failure: BaseException = exc
                except Exception as exc:  # boundary: aiokafka's delivery errors
                    failure = exc
                else:
                    acked.append(out)
                    continue
                # Not acknowledged: the offset stays pending (never committed) and
                # the record is re-sent by _redeliver.
                self._undelivered.append(self._to_resend(out, failure))
                self._delivery_failed.set()
                log.warning("delivery_failed", source=str(out.job.source), error=repr(failure))
            self._acknowledged(acked)
            self._committer.notify()
        finally:
            self._ack_slots.release()

    def _to_resend(self, out: Outgoing, failure: BaseException) -> Outgoing:
        """What to re-send for a record whose send failed: the record itself, or,
        when the broker refused it for good, its small fallback at once (re-sent
        as it was, beside its neighbours in one record batch, the refused bytes
        would have them refused too)."""
        if retriable(failure):
            return out
        # A refusal for good leaves a gap in an idempotent producer's sequence:
        # the records after it fail with a sequence error, and are re-sent as
        # they are, through a new producer.
        self._renew = self._renew or self.idempotent
        if isinstance(failure, _SEQUENCE_BROKEN) or out.fallback:
            return out
        return fallback(out, refusal_code(failure), repr(failure), self._model)

    def _acknowledged(self, acked: list[Outgoing]) -> None:
        now, wall_ms = time.monotonic(), time.time() * 1000.0
        kinds: dict[str, int] = {}
        for out in acked:
            job = out.job
            self._tracker.done(job.tp, job.offset, job.epoch)
            self._metrics.request_seconds.observe(now - job.arrived)
            if job.timestamp_ms is not None and job.timestamp_ms > 0:
                # Wall clocks of two hosts: clamped at 0 when the producer's runs ahead.
                metrics.RECORD_AGE_SECONDS.observe(max(0.0, wall_ms - job.timestamp_ms) / 1000.0)
            kinds[out.kind] = kinds.get(out.kind, 0) + 1
        for kind, count in kinds.items():  # counters per batch, not per record
            if kind == "dlq":
                metrics.DLQ_PRODUCED.inc(count)
            else:
                self._metrics.results(kind).inc(count)

    async def _settle(self) -> None:
        """Wait for every outstanding acknowledgement."""
        while self._ack_tasks:
            await asyncio.gather(*self._ack_tasks)

    async def _redeliver(self) -> None:
        """Re-send unacknowledged records, oldest first, until all are acked."""
        await self._settle()
        metrics.set_condition("delivery", False)
        backoff = self._kafka.retry_backoff_ms / 1000.0
        while self._undelivered:
            if self._renew:
                await self._renew_producer()
            pending = sorted(self._undelivered, key=lambda o: o.seq)
            self._undelivered = []
            live = [o for o in pending if self._tracker.owns(o.job.tp, o.job.offset, o.job.epoch)]
            log.info("redelivering", records=len(live), backoff_s=backoff)
            sent = [(o, await self._send(o)) for o in live]
            metrics.DELIVERY_RETRIES.inc(len(sent))
            outcomes = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
            failed = 0
            for (out, _), outcome in zip(sent, outcomes, strict=True):
                if not isinstance(outcome, BaseException):
                    self._acknowledged([out])
                    continue
                if self.idempotent and isinstance(outcome, _SEQUENCE_BROKEN):
                    self._renew = True  # never written: the same bytes, new producer
                    self._undelivered.append(out)
                    continue
                if retriable(outcome):
                    failed += 1
                    self._undelivered.append(out)
                elif not out.fallback:
                    # Refused for good (e.g. too large for the broker): retrying
                    # the same bytes cannot help; send the small fallback instead.
                    self._renew = self._renew or self.idempotent
                    self._undelivered.append(
                        fallback(out, refusal_code(outcome), repr(outcome), self._model)
                    )
                else:
                    raise DeliveryFailed(
                        f"{out.job.source} cannot be delivered even as an error: {outcome!r}"
                    )
            self._committer.notify()
            if failed:
                # Jittered: twenty workers that lost the broker together must not
                # all come back to it in the same instant.
                await asyncio.sleep(backoff * random.uniform(0.75, 1.25))
                backoff = min(backoff * 2, 10.0)
        metrics.set_condition("delivery", True)
        log.info("delivery_recovered")

    async def _renew_producer(self) -> None:
        """Replace the producer (called with no send of this sink in flight): an
        idempotent producer's partition sequence is broken after a refusal for
        good. A new one gets a new producer id, its sequences start again."""
        backoff = self._kafka.retry_backoff_ms / 1000.0
        while True:
            try:
                producer, idempotent = await self._producer_factory(self._kafka)
                break
            except KafkaError as exc:  # the broker answered a moment ago: retry
                log.warning("producer_renewal_failed", error=repr(exc), backoff_s=backoff)
                await asyncio.sleep(backoff * random.uniform(0.75, 1.25))
                backoff = min(backoff * 2, 10.0)
        old, self.producer, self.idempotent = self.producer, producer, idempotent
        self._renew = False
        log.info("producer_renewed", idempotent=idempotent, reason="a batch was refused for good")
        if old is not None:
            await old.stop()

    async def close(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            await producer.stop()
