"""What both writers share: the producer, answers turned into records, records
handed to the producer grouped per output partition, and the one decision of
what to do with a record whose send failed.

The writers differ in what makes an offset committable: ``at_least_once``
marks it done once the broker acknowledged its record, and the committer
commits it later; ``exactly_once`` commits the records and their offsets
together in one transaction. Encoding, grouping, refusals and the failure
budget are the same in both, and live here; what to send after a failed send
is ``decide``'s (``delivery.decide``), applied here for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaError,
)

from worker.config import KafkaConfig
from worker.contract import ModelInfo
from worker.flow.backoff import Backoff
from worker.flow.budget import FailureBudget
from worker.flow.codes import ErrorCode
from worker.flow.errors import DeliveryFailed, FailureBudgetExceeded
from worker.flow.messages import Answer, Completed, Job, StateChange, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.commit import Committer
from worker.kafka.delivery.decide import (
    Action,
    Verdict,
    decide,
    refusal_code,
)
from worker.kafka.delivery.outgoing import (
    OutRecord,
    Topics,
    fallback,
    record_for,
    state_record,
)
from worker.kafka.delivery.sending import Sent, send_grouped
from worker.kafka.permissions import NOT_AUTHORISED
from worker.obs import metrics
from worker.obs.logs import RateLimited
from worker.obs.tracing import Tracer, answer_span

log = structlog.get_logger(__name__)

ProducerFactory = Callable[[KafkaConfig], Awaitable[tuple[AIOKafkaProducer, bool]]]


# How many jobs with two records in flight before the map is swept of those
# whose partition was revoked (their acknowledgements never come).
_PENDING_SWEEP = 10_000


class Woken(enum.Enum):
    """What ``Writer._next_or_woken`` returns when woken, not by a batch."""

    WOKEN = 1


@dataclass(frozen=True)
class WriterParts:
    """What every writer is given: the completed batches it reads, where answers
    go and for which model, the offsets it settles and who commits them."""

    completed_in: asyncio.Queue[asyncio.Future[Completed] | None]
    kafka: KafkaConfig
    model: ModelInfo
    tracker: OffsetTracker
    committer: Committer
    budget: FailureBudget | None = None
    tracer: Tracer | None = None


def _rejection(answer: Answer) -> str | None:
    """The code an answer was refused with without running the model (counted in
    ``infer_requests_rejected_total``), or None: answered by the model, or its
    run failed (``inference_failed``, counted as batch failures)."""
    job = answer.job
    if job.failure is not None:
        return job.failure.code
    if answer.error is not None and answer.error.code != ErrorCode.INFERENCE_FAILED:
        return answer.error.code
    return None


class Writer:
    """The producer and everything about a record up to handing it over."""

    def __init__(self, parts: WriterParts, producer_factory: ProducerFactory) -> None:
        kafka, model = parts.kafka, parts.model
        self._completed_in = parts.completed_in
        self._committer = parts.committer
        self._kafka = kafka
        self._tracer = parts.tracer or Tracer()
        self._model = model
        self._tracker = parts.tracker
        self._budget = parts.budget
        self._seq = 0
        self._rejections = RateLimited(burst=10, interval=10.0)
        self._topics = Topics(output=kafka.output_topic, dlq=kafka.dlq_topic)
        self._shadow = kafka.shadow  # a shadow writes no DLQ records
        self._producer_factory = producer_factory
        self._overdue = kafka.request_timeout_s
        self._overdue_waits = 0
        # Records still unacknowledged of jobs that have more than one (an answer
        # and its state record), by (partition, offset, epoch).
        self._pending: dict[tuple[TopicPartition, int, int], int] = {}
        self.producer: AIOKafkaProducer | None = None
        self.idempotent = False

    async def fence(self, revoked: set[TopicPartition]) -> None:
        """On revocation, just before the partitions are forgotten: nothing to do
        under at-least-once (an answer is settled by its acknowledgement);
        exactly-once aborts an open transaction holding theirs."""

    def backoff(self) -> Backoff:
        """Waits between retries, from ``kafka.retry_backoff_ms`` (doubling to 10 s)."""
        return Backoff(self._kafka.retry_backoff_ms / 1000.0)

    async def start(self) -> None:
        self.producer, self.idempotent = await self._producer_factory(self._kafka)
        log.info("producer_started", idempotent=self.idempotent)

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> Any:
        """One record through the current producer, acknowledged (for the crash
        guard's marks: the producer may be replaced, see ``_replace_producer``)."""
        assert self.producer is not None, "start() first"
        return await self.producer.send_and_wait(topic, value, key=key)

    async def existing_topics(self) -> set[str]:
        """Topics the cluster has, from one metadata request for all topics (which,
        unlike a request naming a topic, never auto-creates one)."""
        assert self.producer is not None, "start() first"
        cluster = await self.producer.client.fetch_all_metadata()
        return set(cluster.topics())

    async def _next_or_woken(self, wake: asyncio.Event) -> asyncio.Future[Completed] | Woken | None:
        """The next item of the queue (a batch's future, or None at the end), or
        ``WOKEN`` as soon as ``wake`` is set (records wait to be sent again)."""
        if not self._completed_in.empty():
            return self._completed_in.get_nowait()
        getter = asyncio.ensure_future(self._completed_in.get())
        woken = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({getter, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not getter.done():
                # Leaves an item it was woken for in the queue: Queue.get()
                # removes it only after its wait returns, never when cancelled.
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        wake.clear()
        return Woken.WOKEN

    async def _completed(self, fut: asyncio.Future[Completed]) -> Completed:
        """A batch the inference stage dispatched, once it completed: no longer in
        flight (the stage counted it in). ``EngineDead`` propagates: the worker
        stops, uncommitted."""
        completed = await fut
        metrics.INFLIGHT_BATCHES.dec()
        return completed

    def _records(self, completed: Completed) -> list[OutRecord]:
        """The records for a completed batch's answers, skipping those of
        partitions revoked or reset meanwhile (their new owner answers them);
        each counts against the failure budget."""
        now = time.monotonic()
        outs: list[OutRecord] = []
        model = self._model_of(completed)
        rejected: Counter[tuple[str, str]] = Counter()  # by (topic, code)
        for answer in completed.answers:
            job = answer.job
            if not self._tracker.owns(job.tp, job.offset, job.epoch):
                continue  # partition revoked or reset meanwhile: its new owner answers it
            code = _rejection(answer)
            if code is not None:
                rejected[job.tp.topic, code] += 1
            self._seq += 1
            trace = None
            if job.trace is not None or self._tracer.exporting:
                trace = answer_span(self._tracer, answer, model.name,
                                    len(completed.answers), now)  # fmt: skip
            out = record_for(
                answer, model, self._topics, self._seq, now, self._kafka.max_request_size, trace
            )
            if model is not self._model:
                out.model_version = model.version  # its latency is that version's
            if self._budget is not None:
                failed = out.kind == "dlq" or (
                    answer.error is not None and answer.error.code == ErrorCode.INFERENCE_FAILED
                )
                reason = self._budget.record(failed)
                if reason is not None:
                    raise FailureBudgetExceeded(
                        f"halting: {reason}; last at {job.tp.topic}:{job.tp.partition}@{job.offset}"
                    )
            if out.kind != "ok":
                self._log_rejection(out)
            if out.kind == "dlq" and self._shadow:
                # Logged and counted above (infer_requests_rejected_total):
                # answered, as far as its offset goes, without a record.
                self._tracker.done(job.tp, job.offset, job.epoch)
                self._committer.notify()
                continue
            outs.append(out)
            if answer.state is not None and self._kafka.state_topic and out.kind != "dlq":
                outs.append(self._state_record(answer.job, answer.state))
        for (topic, code), count in rejected.items():  # the one place rejections are counted
            metrics.REQUESTS_REJECTED.labels(code=code).inc(count)
            lane = self._kafka.ranked_lanes[self._kafka.lane_rank.get(topic, 0)].label
            metrics.LANE_REJECTED.labels(lane=lane, code=code).inc(count)
        return outs

    def _model_of(self, completed: Completed) -> ModelInfo:
        """The model that answered ``completed``: the start-up one, or the version
        swapped in since (results carry it)."""
        version = completed.model_version
        if version is None or version == self._model.version:
            return self._model
        return ModelInfo(self._model.name, version)

    def _state_record(self, job: Job, change: StateChange) -> OutRecord:
        """The state record of ``job`` (``outgoing.state_record``); the job's
        offset counts as done only once it and the answer are both acknowledged."""
        self._seq += 1
        key = (job.tp, job.offset, job.epoch)
        if len(self._pending) >= _PENDING_SWEEP:  # jobs of revoked partitions: never acked
            self._pending = {k: n for k, n in self._pending.items() if self._tracker.owns(*k)}
        self._pending[key] = self._pending.get(key, 1) + 1
        metrics.STATE_PENDING.set(len(self._pending))
        return state_record(job, change, self._kafka.state_topic, self._seq)

    def _next_attempts(
        self, failed: list[tuple[OutRecord, BaseException | None, bool]]
    ) -> list[tuple[OutRecord, Verdict]]:
        """``decide``, applied to records not acknowledged, each with why (None: its
        transaction failed for another reason) and whether it was sent alone: the
        records to send next (each itself or its fallback), in request order. A
        failure is ``shared`` when the same exception struck several records (the
        broker refused their record batch as a whole). Raises ``DeliveryFailed``
        when even a fallback was refused."""
        struck = Counter(id(f) for _, f, _ in failed if f is not None)
        for f in {id(f): f for _, f, _ in failed if isinstance(f, NOT_AUTHORISED)}.values():
            self._rejections(
                log.error, "not_authorised", error=repr(f), effect="answers wait, "
                "offsets stay uncommitted, delivery is not ready until the ACL is back",
                fix='README "Secured Kafka" lists every ACL a worker needs',
            )  # fmt: skip
        todo = []
        for record, failure, alone in sorted(failed, key=lambda t: t[0].seq):
            shared = failure is not None and struck[id(failure)] > 1
            verdict = decide(
                record, failure, idempotent=self.idempotent, shared=shared, alone=alone
            )
            if verdict.action is Action.GIVE_UP:
                raise DeliveryFailed(
                    f"{record.job.source} cannot be delivered even as an error: {failure!r}"
                )
            nxt = record
            if verdict.action is Action.FALL_BACK:
                assert failure is not None
                nxt = fallback(record, refusal_code(failure), repr(failure), self._model)
            todo.append((nxt, verdict))
        return todo

    def _log_rejection(self, out: OutRecord) -> None:
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
            sent_to="result" if out.kind != "dlq" else "none (shadow)" if self._shadow else "dlq",
        )

    async def _send_grouped(self, outs: list[OutRecord]) -> Sent:
        """A completed batch's records to the producer (``sending.send_grouped``)."""
        assert self.producer is not None, "start() first"
        return await send_grouped(self.producer, outs)

    async def _watched(self, fut: Awaitable[object]) -> object:
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

    def _acknowledged(self, acked: list[OutRecord]) -> None:
        """Mark offsets done and count what was delivered, per batch."""
        now, wall_ms = time.monotonic(), time.time() * 1000.0
        # Per answering model version (one, but for the batches around a swap).
        kinds: dict[tuple[str, str], int] = {}
        latencies: dict[str, list[float]] = {}
        ages: list[float] = []
        for out in acked:
            job = out.job
            key = (job.tp, job.offset, job.epoch)
            left = self._pending.pop(key, 1) - 1
            if left:  # its answer or its state record is still unacknowledged
                self._pending[key] = left
            else:
                self._tracker.done(job.tp, job.offset, job.epoch)
            if out.kind == "state":
                metrics.STATE_RECORDS.inc()
                continue
            version = out.model_version or self._model.version
            if (seen := latencies.get(version)) is None:
                seen = latencies[version] = []
            seen.append(now - job.arrived)
            if job.timestamp_ms is not None and job.timestamp_ms > 0:
                # Wall clocks of two hosts: clamped at 0 when the producer's runs ahead.
                ages.append(max(0.0, wall_ms - job.timestamp_ms) / 1000.0)
            kinds[version, out.kind] = kinds.get((version, out.kind), 0) + 1
        for version, seconds in latencies.items():
            m = metrics.model_metrics(self._model.name, version)
            metrics.observe_all(m.request_seconds, seconds)
        metrics.observe_all(metrics.RECORD_AGE_SECONDS, ages)
        if self._kafka.state_topic:
            metrics.STATE_PENDING.set(len(self._pending))
        for (version, kind), count in kinds.items():  # counters per batch, not per record
            if kind == "dlq":
                metrics.DLQ_PRODUCED.inc(count)
            else:
                metrics.model_metrics(self._model.name, version).results(kind).inc(count)

    async def _replace_producer(self, reason: str) -> None:
        """Replace the producer (called with no send of this writer in flight): an
        idempotent producer's partition sequence is broken after a refusal for
        good, and a transactional one may be left in a state it cannot leave. A
        new one gets a new producer id or epoch; its sequences start again (a
        transactional one's InitProducerId also aborts the old one's open
        transaction). The old one is closed within the request timeout: its
        pending batches may be bound for a broker that is gone."""
        backoff = self.backoff()
        while True:
            try:
                producer, idempotent = await self._producer_factory(self._kafka)
                break
            except KafkaError as exc:  # the broker answered a moment ago: retry
                log.warning("producer_renewal_failed", error=repr(exc),
                            backoff_s=backoff.current)  # fmt: skip
                await asyncio.sleep(backoff.next())
        old, self.producer, self.idempotent = self.producer, producer, idempotent
        log.info("producer_renewed", idempotent=idempotent, reason=reason)
        if old is not None:
            try:
                await asyncio.wait_for(old.stop(), self._overdue)
            except (KafkaError, TimeoutError) as exc:
                log.warning("old_producer_close_failed", error=repr(exc))

    async def close(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            await producer.stop()
