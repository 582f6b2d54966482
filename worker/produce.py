"""ResultSink: encode answers, produce results / DLQ records, await broker acks.

Completed batches arrive in dispatch order and are sent in that order, so results
of one input partition are produced in request order. Acks are awaited in a
background task per batch (bounded), so the next batch's sends overlap the
previous batch's acknowledgement; only acknowledged offsets are marked done in
the tracker, which is what lets the committer move the watermark.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog
from aiokafka import AIOKafkaProducer

from . import __version__, metrics
from .codec import ErrorInfo, ModelInfo, Result, Tensor, encode_result
from .commit import Committer, OffsetTracker
from .config import KafkaConfig
from .consume import Job
from .errors import DeliveryFailed, InvalidRequest, UndecodableRecord
from .infer import Answer, Completed
from .kafka import client_kwargs

log = structlog.get_logger(__name__)

# Room for the record batch framing around one record, so a result that passes
# this check is never rejected by the producer's own size limit.
_RECORD_OVERHEAD = 1024


def dlq_headers(job: Job, code: str, message: str, stage: str) -> list[tuple[str, bytes]]:
    return [
        ("error.code", code.encode()),
        ("error.message", message.encode()[:1024]),
        ("source.topic", job.tp.topic.encode()),
        ("source.partition", str(job.tp.partition).encode()),
        ("source.offset", str(job.offset).encode()),
        ("stage", stage.encode()),
        ("worker.version", __version__.encode()),
    ]


def build_result(answer: Answer, model: ModelInfo, now: float) -> Result:
    """The wire result for one answer (never for a DLQ-bound record)."""
    job = answer.job
    timing = dict(answer.timing_us)
    timing["total"] = round((now - job.arrived) * 1e6)
    request_id, meta = "", None
    if job.request is not None:
        request_id, meta = job.request.id, job.request.meta
    failure = job.failure
    if isinstance(failure, InvalidRequest):
        request_id, meta = failure.request_id, failure.meta
    error = answer.error
    if failure is not None:
        error = ErrorInfo(failure.code, str(failure))
    if error is not None:
        return Result(
            id=request_id,
            status="error",
            source=job.source,
            model=model,
            error=error,
            meta=meta,
            timing_us=timing,
        )
    assert answer.outputs is not None
    outputs = {name: Tensor.from_numpy(arr) for name, arr in answer.outputs.items()}
    return Result(
        id=request_id,
        status="ok",
        source=job.source,
        model=model,
        outputs=outputs,
        meta=meta,
        timing_us=timing,
    )


class ResultSink:
    def __init__(
        self,
        source: asyncio.Queue[asyncio.Future[Completed] | None],
        kafka: KafkaConfig,
        model: ModelInfo,
        tracker: OffsetTracker,
        committer: Committer,
        max_pending_acks: int,
    ) -> None:
        self._source = source
        self._kafka = kafka
        self._model = model
        self._tracker = tracker
        self._committer = committer
        self._ack_slots = asyncio.Semaphore(max_pending_acks)
        self._ack_tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self.producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        k = self._kafka
        producer = AIOKafkaProducer(
            acks="all",
            max_request_size=k.max_request_size,
            compression_type=None if k.compression_type == "none" else k.compression_type,
            linger_ms=k.linger_ms,
            **client_kwargs(k),
        )
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        self.producer = producer

    async def run(self) -> None:
        while (fut := await self._source.get()) is not None:
            completed = await fut  # EngineDead propagates: the worker stops, uncommitted
            metrics.INFLIGHT_BATCHES.dec()
            await self._send_batch(completed)
            if self._failure is not None:
                raise DeliveryFailed(f"results not acknowledged: {self._failure!r}")
        if self._ack_tasks:
            await asyncio.gather(*self._ack_tasks)
        if self._failure is not None:
            raise DeliveryFailed(f"results not acknowledged: {self._failure!r}")

    async def _send_batch(self, completed: Completed) -> None:
        now = time.monotonic()
        sent: list[tuple[Job, asyncio.Future[object], str]] = []
        for answer in completed.answers:
            job = answer.job
            if not self._tracker.owns(job.tp, job.offset):
                continue  # partition revoked meanwhile: its new owner answers it
            if isinstance(job.failure, UndecodableRecord):
                ack = await self._send_dlq(job, job.failure.code, str(job.failure), "decode")
                sent.append((job, ack, "dlq"))
            else:
                ack, status = await self._send_result(answer, now)
                sent.append((job, ack, status))
        if not sent:
            return
        await self._ack_slots.acquire()
        task = asyncio.create_task(self._await_acks(sent))
        self._ack_tasks.add(task)
        task.add_done_callback(self._ack_tasks.discard)

    async def _send_result(self, answer: Answer, now: float) -> tuple[asyncio.Future[object], str]:
        job = answer.job
        result = build_result(answer, self._model, now)
        value = encode_result(result)
        if len(value) + len(job.key or b"") + _RECORD_OVERHEAD > self._kafka.max_request_size:
            message = f"result of {len(value)} bytes exceeds kafka.max_request_size"
            small = Result(
                id=result.id,
                status="error",
                source=result.source,
                model=self._model,
                error=ErrorInfo("too_large", message),
                meta=result.meta,
                timing_us=result.timing_us,
            )
            value = encode_result(small)
        ack = await self._send(
            self._kafka.output_topic, job.key, value, [("id", result.id.encode())]
        )
        return ack, result.status

    async def _send_dlq(
        self, job: Job, code: str, message: str, stage: str
    ) -> asyncio.Future[object]:
        return await self._send(
            self._kafka.dlq_topic, job.key, job.raw_value, dlq_headers(job, code, message, stage)
        )

    async def _send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> asyncio.Future[object]:
        assert self.producer is not None, "start() first"
        fut: asyncio.Future[object] = await self.producer.send(
            topic, value=value, key=key, headers=list(headers)
        )
        return fut

    async def _await_acks(self, sent: list[tuple[Job, asyncio.Future[object], str]]) -> None:
        try:
            outcomes = await asyncio.gather(*(ack for _, ack, _ in sent), return_exceptions=True)
            now = time.monotonic()
            for (job, _, kind), outcome in zip(sent, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    # Not acknowledged: the offset stays pending, so it is never
                    # committed and will be redelivered.
                    self._failure = self._failure or outcome
                    log.error("delivery_failed", source=str(job.source), error=repr(outcome))
                    continue
                self._tracker.done(job.tp, job.offset)
                metrics.REQUEST_SECONDS.observe(now - job.arrived)
                if kind == "dlq":
                    metrics.DLQ_PRODUCED.inc()
                else:
                    metrics.RESULTS_PRODUCED.labels(status=kind).inc()
            self._committer.notify()
        finally:
            self._ack_slots.release()

    async def close(self) -> None:
        producer, self.producer = self.producer, None
        if producer is not None:
            await producer.stop()
