"""AtLeastOnceWriter: encode answers, produce results / DLQ records, await acks.

Completed batches arrive in dispatch order and are sent in that order, so results
of one input partition are produced in request order. Batches that completed
behind the one awaited are sent with it (one record batch per output partition
for all of them, so one produce request): under a backlog the broker then takes
fewer, fuller requests, and nothing ever waits for a batch to complete. Acks
are awaited in a background task per send (bounded), so the next sends overlap
the previous acknowledgement; only acknowledged offsets are marked done in the
tracker, which is what lets the committer move the watermark.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer

from worker.flow.messages import Completed, TopicPartition
from worker.flow.streams import Woken
from worker.kafka.clients import start_producer
from worker.kafka.delivery.answers import Answers
from worker.kafka.delivery.decide import Action, Verdict, retriable
from worker.kafka.delivery.outgoing import OutRecord
from worker.kafka.delivery.producing import ProducerFactory, Producing
from worker.kafka.delivery.sending import Sent
from worker.kafka.delivery.writer import Completions, WriterParts
from worker.kafka.topiccheck import MissingTopics
from worker.obs import metrics
from worker.obs.logs import RateLimited

log = structlog.get_logger(__name__)

__all__ = ["AtLeastOnceWriter", "ProducerFactory"]


class AtLeastOnceWriter:
    """Produces answers in order, awaits acks, marks offsets done.

    When acknowledgements fail (broker unreachable, timeouts), nothing is marked
    done for those records; the writer stops taking new batches, reports not-ready,
    and re-sends the unacknowledged records with exponential backoff until the
    broker takes them. Upstream queues then fill and backpressure pauses fetching,
    so memory stays bounded however long the outage lasts.
    """

    def __init__(
        self,
        parts: WriterParts,
        max_pending_acks: int,
        producer_factory: ProducerFactory = start_producer,
    ) -> None:
        self._producing = Producing(parts.kafka, producer_factory, lane_producer=True)
        self._answers = Answers(parts)
        self._batches = Completions(parts.completed_in)
        self._committer, self._tracker = parts.committer, parts.tracker
        self._ack_slots = asyncio.Semaphore(max_pending_acks)
        self._ack_tasks: set[asyncio.Task[None]] = set()
        # Records not acknowledged, with why, and whether they were sent in a record
        # batch of their own: decide() says what is sent next.
        self._undelivered: list[tuple[OutRecord, BaseException | None, bool]] = []
        self._delivery_failed = asyncio.Event()  # set when an ack fails
        self._failure_lines = RateLimited(burst=10, interval=10.0)
        self._missing = MissingTopics(parts.kafka)  # a topic gone: one line, not one a record
        # Taken from the queue behind a send's batches but not completed yet (or
        # the end of the stream): the next send's first.
        self._held: list[asyncio.Future[Completed] | None] = []
        self._coalesce = max_pending_acks  # completed batches sent together at most

    @property
    def producer(self) -> AIOKafkaProducer | None:
        return self._producing.producer

    async def start(self) -> None:
        await self._producing.start()

    async def existing_topics(self) -> set[str]:
        return await self._producing.existing_topics()

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> Any:
        return await self._producing.send_and_wait(topic, value, key)

    async def fence(self, revoked: set[TopicPartition]) -> None:
        """Nothing to do on revocation: an answer is settled by its acknowledgement."""

    async def close(self) -> None:
        await self._producing.close()

    async def run(self) -> None:
        while (fut := await self._next()) is not None:
            batches = [await self._batches.completed(fut)]
            while len(batches) < self._coalesce and (behind := self._done_behind()):
                batches.append(await self._batches.completed(behind))
            await self._send_batch(batches)
        await self._settle()
        if self._undelivered:
            await self._redeliver()

    def _done_behind(self) -> asyncio.Future[Completed] | None:
        """The next queued batch if it already completed, else None (it is held
        for the next send, as is the end of the stream)."""
        if self._held or self._batches.queue.empty():
            return None
        item = self._batches.queue.get_nowait()
        if item is None or not item.done():
            self._held.append(item)
            return None
        return item

    async def _next(self) -> asyncio.Future[Completed] | None:
        """The next completed batch; records whose acks fail meanwhile are re-sent
        while waiting for it. Redelivering only when a batch arrives left the last
        failed records of a burst pending for good: while fetching is paused
        because they are in flight, no batch ever comes (a deadlock), and on an
        idle topic their clients wait for unrelated traffic."""
        while True:
            if self._undelivered:
                await self._redeliver()
            if self._held:
                return self._held.pop()
            item = await self._batches.next_or_woken(self._delivery_failed)
            if item is not Woken.WOKEN:
                return item

    async def _send_batch(self, batches: list[Completed]) -> None:
        outs = [out for completed in batches for out in self._answers.records(completed)]
        if not outs:
            return
        sent = await self._producing.send_grouped(outs)
        await self._ack_slots.acquire()
        task = asyncio.create_task(self._await_acks(sent))
        self._ack_tasks.add(task)
        task.add_done_callback(self._ack_tasks.discard)

    async def _await_acks(self, sent: Sent) -> None:
        acked: list[OutRecord] = []
        try:
            # boundary: aiokafka's delivery errors
            failures = await self._producing.failures(sent, caught=(Exception,))
            if not failures:  # the common case: the whole send acknowledged
                acked = [out for out, _ in sent]
            else:
                for out, ack in sent:
                    failure = failures.get(id(ack))
                    if failure is None:
                        acked.append(out)
                    else:
                        self._set_aside(out, failure)
            self._answers.acknowledged(acked)
            self._committer.notify()
        finally:
            self._ack_slots.release()

    def _set_aside(self, out: OutRecord, failure: BaseException) -> None:
        """A record not acknowledged: its offset stays pending (never committed);
        ``_redeliver`` decides what is sent instead."""
        self._undelivered.append((out, failure, False))
        self._delivery_failed.set()
        if self._missing.refused(out.topic, failure):
            return
        # Per record, but held to a few lines per interval: one broker refusal
        # fails every record in flight.
        self._failure_lines(log.warning, "delivery_failed", topic=out.topic,
                            source=str(out.job.source), error=repr(failure))  # fmt: skip

    async def _settle(self) -> None:
        """Wait for every outstanding acknowledgement."""
        while self._ack_tasks:
            await asyncio.gather(*self._ack_tasks)

    async def _redeliver(self) -> None:
        """Send again what was not acknowledged, oldest first, as ``decide`` says
        (the same bytes, each alone, or a fallback), until everything is. Each
        record goes in a record batch of its own: the producer's own batching
        would put refused records beside others again, and their fallbacks too.
        A record that may be refused again (one refused with its neighbours) is
        sent alone and awaited before anything after it, so the results of a
        partition stay in request order whatever becomes of it."""
        await self._settle()
        metrics.set_condition("delivery", False)
        backoff = self._producing.backoff()
        while self._undelivered:
            failures = [
                (o, f, alone) for o, f, alone in self._undelivered
                if self._tracker.owns(o.job.tp, o.job.offset, o.job.epoch)
            ]  # fmt: skip
            self._undelivered = []
            todo = self._answers.next_attempts(failures, self._producing.idempotent)
            if any(verdict.renew for _, verdict in todo):
                await self._producing.replace("a record was refused for good")
            log.info("redelivering", records=len(todo), backoff_s=backoff.current)
            if await self._send_in_order(todo):
                await asyncio.sleep(backoff.next())  # the broker is away: wait for it
            self._committer.notify()
        metrics.set_condition("delivery", True)
        self._missing.delivered()
        log.info("delivery_recovered")

    async def _send_in_order(self, todo: list[tuple[OutRecord, Verdict]]) -> bool:
        """One round of redelivery; what fails goes back to ``_undelivered``.
        True when a failure was one the broker may get over (wait, then retry)."""
        burst: list[OutRecord] = []
        unreachable = False
        for i, (out, verdict) in enumerate(todo):
            if verdict.action is not Action.RESEND_ALONE:
                burst.append(out)
                continue
            unreachable = await self._send_each(burst) or unreachable
            burst = []
            (sent,) = await self._producing.send_grouped([out])
            try:
                await self._producing.watched(sent[1])
            except Exception as exc:  # boundary: aiokafka's delivery errors
                # Refused again, alone: nothing after it goes before its fallback.
                self._undelivered.append((out, exc, True))
                self._undelivered += [(o, None, True) for o, _ in todo[i + 1 :]]
                return unreachable or retriable(exc)
            self._answers.acknowledged([out])
        return await self._send_each(burst) or unreachable

    async def _send_each(self, outs: list[OutRecord]) -> bool:
        """``outs`` each in a record batch of its own, all at once, in order."""
        sent = [pair for o in outs for pair in await self._producing.send_grouped([o])]
        metrics.DELIVERY_RETRIES.inc(len(sent))
        outcomes = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
        unreachable = False
        for (out, _), outcome in zip(sent, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self._undelivered.append((out, outcome, True))
                unreachable = unreachable or retriable(outcome)
            else:
                self._answers.acknowledged([out])
        return unreachable
