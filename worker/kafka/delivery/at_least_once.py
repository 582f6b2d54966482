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

import structlog

from worker.config import KafkaConfig
from worker.contract import ModelInfo
from worker.flow.budget import FailureBudget
from worker.flow.errors import DeliveryFailed
from worker.flow.messages import Completed
from worker.flow.offsets import OffsetTracker
from worker.kafka.clients import start_producer
from worker.kafka.commit import Committer
from worker.kafka.delivery.outgoing import Outgoing, fallback
from worker.kafka.delivery.writer import (
    SEQUENCE_BROKEN,
    ProducerFactory,
    Sent,
    Writer,
    refusal_code,
    retriable,
)
from worker.obs import metrics
from worker.obs.tracing import Tracer

log = structlog.get_logger(__name__)

__all__ = ["ProducerFactory", "ResultSink", "refusal_code", "retriable"]


class ResultSink(Writer):
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
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__(kafka, model, tracker, budget, producer_factory, tracer)
        self._source = source
        self._committer = committer
        self._ack_slots = asyncio.Semaphore(max_pending_acks)
        self._ack_tasks: set[asyncio.Task[None]] = set()
        self._undelivered: list[Outgoing] = []
        self._delivery_failed = asyncio.Event()  # set when an ack fails
        self._renew = False  # an idempotent producer's sequence may be broken

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
        outs = self._outgoing(completed)
        if not outs:
            return
        sent = await self._send_grouped(outs)
        await self._ack_slots.acquire()
        task = asyncio.create_task(self._await_acks(sent))
        self._ack_tasks.add(task)
        task.add_done_callback(self._ack_tasks.discard)

    async def _await_acks(self, sent: Sent) -> None:
        acked: list[Outgoing] = []
        try:
            # One by one, not gather(): a batch's acks arrive together, so after the
            # first wait the rest are already done and awaiting them costs nothing.
            for out, ack in sent:
                try:
                    await self._watched(ack)
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
        if isinstance(failure, SEQUENCE_BROKEN) or out.fallback:
            return out
        return fallback(out, refusal_code(failure), repr(failure), self._model)

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
                if self.idempotent and isinstance(outcome, SEQUENCE_BROKEN):
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
        """A new producer (no send of this sink in flight): see ``Writer._replace_producer``."""
        await self._replace_producer("a batch was refused for good")
        self._renew = False
