"""A writer's producer: started, replaced after a refusal for good, closed; a
batch's records handed to it grouped per output partition, and acknowledgements
watched for the readiness probe. Both writers hold one (``at_least_once``,
``exactly_once``); the transactional calls are the exactly-once writer's own.

With priority lanes the at-least-once writer's most urgent lane has a producer
of its own (``lane_producer``). aiokafka keeps one produce request in flight per
connection, and ``send_batch`` waits until the partition's previous batch left:
an urgent result queued behind the bulk lane's request and the batch pending
after it (22 ms at the median under a bulk backlog, against 1 ms with no bulk
traffic; BENCHMARKS.md, priority lanes). An input partition is in one lane, so
its results, DLQ and state records all go through one producer, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from worker.config import KafkaConfig
from worker.flow.backoff import Backoff
from worker.kafka.delivery.outgoing import OutRecord
from worker.kafka.delivery.sending import Sent, send_grouped
from worker.kafka.topiccheck import existing_topics
from worker.obs import metrics

log = structlog.get_logger(__name__)

ProducerFactory = Callable[[KafkaConfig], Awaitable[tuple[AIOKafkaProducer, bool]]]


class Producing:
    def __init__(
        self, kafka: KafkaConfig, factory: ProducerFactory, lane_producer: bool = False
    ) -> None:
        """``lane_producer``: with two or more lanes, the most urgent lane's records
        go through a producer of their own (``urgent``)."""
        self._kafka = kafka
        self._factory = factory
        self._overdue = kafka.request_timeout_s
        self._overdue_waits = 0
        self.producer: AIOKafkaProducer | None = None
        self.urgent: AIOKafkaProducer | None = None
        own = lane_producer and kafka.has_lanes
        self._urgent_topics = frozenset(kafka.ranked_lanes[0].topics) if own else frozenset()
        self.idempotent = False

    def backoff(self) -> Backoff:
        """Waits between retries, from ``kafka.retry_backoff_ms`` (doubling to 10 s)."""
        return Backoff(self._kafka.retry_backoff_ms / 1000.0)

    @property
    def overdue_s(self) -> float:
        """How long an acknowledgement may take before delivery is reported late."""
        return self._overdue

    async def start(self) -> None:
        await self._open(self._factory)
        log.info("producer_started", idempotent=self.idempotent,
                 urgent_lane_producer=self.urgent is not None)  # fmt: skip

    async def _open(self, make: ProducerFactory) -> None:
        """The producer, and the urgent lane's where it has one. ``idempotent``
        decides whether a refusal for good renews them (``decide``): true if
        either is, since ``enable_idempotence = "auto"`` may end differently for
        two starts (a probe timing out), and a broken idempotent sequence left
        unrenewed would be refused for ever."""
        producer, idempotent = await make(self._kafka)
        urgent = None
        if self._urgent_topics:
            urgent, own = await make(self._kafka)
            idempotent = idempotent or own
        self.producer, self.urgent, self.idempotent = producer, urgent, idempotent

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> Any:
        """One record through the current producer, acknowledged (for the crash
        guard's marks: the producer may be replaced, see ``replace``)."""
        assert self.producer is not None, "start() first"
        return await self.producer.send_and_wait(topic, value, key=key)

    async def existing_topics(self) -> set[str]:
        """Topics the cluster has (``topiccheck.existing_topics``)."""
        assert self.producer is not None, "start() first"
        return await existing_topics(self.producer.client)

    async def send_grouped(self, outs: list[OutRecord]) -> Sent:
        """A completed batch's records to the producer (``sending.send_grouped``)."""
        assert self.producer is not None, "start() first"
        if self.urgent is None:
            return await send_grouped(self.producer, outs)
        urgent: list[OutRecord] = []
        rest: list[OutRecord] = []
        for out in outs:
            (urgent if out.job.tp.topic in self._urgent_topics else rest).append(out)
        if not urgent:
            return await send_grouped(self.producer, outs)
        # The urgent lane's first: its producer never waits on the other's.
        sent = await send_grouped(self.urgent, urgent)
        return sent + await send_grouped(self.producer, rest) if rest else sent

    async def failures(
        self,
        sent: Sent,
        caught: tuple[type[BaseException], ...],
        fatal: tuple[type[BaseException], ...] = (),
    ) -> dict[int, BaseException]:
        """Wait for every acknowledgement of ``sent``: the failures, by ``id`` of
        the future. The records of a record batch share its future, so each is
        awaited once, not once per record (one by one: a batch's acks arrive
        together, so after the first wait the rest are done). A failure of a
        type in ``caught`` is collected, one in ``fatal`` raised at once, and so
        is a cancellation of this task (not of a send)."""
        failed: dict[int, BaseException] = {}
        for ack in _distinct(sent):
            try:
                await self.watched(ack)
            except fatal:
                raise
            except asyncio.CancelledError as exc:
                if not ack.cancelled():
                    raise  # this task was cancelled, not the send
                failed[id(ack)] = exc
            except caught as exc:
                failed[id(ack)] = exc
        return failed

    async def watched(self, fut: Awaitable[object]) -> object:
        """Await an acknowledgement or a commit; while one has taken longer than
        ``request_timeout_ms`` the worker reports not-ready (condition "acks").
        An idempotent or transactional producer never gives up on a send, so a
        partition without a leader (its broker killed, too few in-sync replicas)
        otherwise looked ready for as long as it lasted."""
        task = asyncio.ensure_future(fut)
        if task.done():
            return task.result()
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(task), self._overdue)
        self._overdue_waits += 1
        metrics.set_condition("acks", False)
        try:
            return await task
        finally:
            self._overdue_waits -= 1
            if not self._overdue_waits:
                metrics.set_condition("acks", True)

    async def replace(self, reason: str) -> None:
        """Replace the producer (called with no send of this writer in flight): an
        idempotent producer's partition sequence is broken after a refusal for
        good, and a transactional one may be left in a state it cannot leave. A
        new one gets a new producer id or epoch; its sequences start again (a
        transactional one's InitProducerId also aborts the old one's open
        transaction). The old one is closed within the request timeout: its
        pending batches may be bound for a broker that is gone. The urgent lane's
        producer is replaced with it (which of them was refused is not known
        here, and both are idle)."""
        old = [self.producer, self.urgent]
        await self._open(self._renewed)
        log.info("producer_renewed", idempotent=self.idempotent, reason=reason)
        for producer in old:
            if producer is None:
                continue
            try:
                await asyncio.wait_for(producer.stop(), self._overdue)
            except (KafkaError, TimeoutError) as exc:
                log.warning("old_producer_close_failed", error=repr(exc))

    async def _renewed(self, kafka: KafkaConfig) -> tuple[AIOKafkaProducer, bool]:
        """A new producer, retried until the broker gives one."""
        backoff = self.backoff()
        while True:
            try:
                return await self._factory(kafka)
            except KafkaError as exc:  # the broker answered a moment ago: retry
                log.warning("producer_renewal_failed", error=repr(exc),
                            backoff_s=backoff.current)  # fmt: skip
                await asyncio.sleep(backoff.next())

    async def close(self) -> None:
        producers, self.producer, self.urgent = (self.producer, self.urgent), None, None
        for producer in producers:
            if producer is not None:
                await producer.stop()


def _distinct(sent: Sent) -> list[asyncio.Future[object]]:
    """The futures of ``sent`` once each, in order. A record batch's records
    are consecutive and share its future, so comparing with the last one
    suffices; a future seen again further on is awaited again, harmlessly
    (it is done by then)."""
    out: list[asyncio.Future[object]] = []
    last = None
    for _, ack in sent:
        if ack is not last:
            out.append(ack)
            last = ack
    return out
