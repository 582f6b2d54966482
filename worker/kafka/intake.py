"""Intake: one consumer record in, one ``Job`` out: decode, validate, never raise.

Records are decoded and validated here, before any engine work: a record that
fails becomes a ``Job`` carrying its failure, and still flows through the
pipeline in order, so per-partition result order equals request order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from worker.config import LimitsConfig
from worker.contract import Limits, decode_request
from worker.contract.oip import CONTENT_TYPE as JSON
from worker.contract.oip import MSGPACK, decode_oip_request
from worker.flow.errors import RecordError, UndecodableRecord
from worker.flow.messages import Job, TopicPartition
from worker.model.inputs import ModelInputs
from worker.obs import metrics
from worker.obs.tracing import parse as parse_trace

Headers = Sequence[tuple[str, bytes]]

Clock = Callable[[], float]


def epoch_ms_to_monotonic(deadline_ms: int, clock: Clock = time.monotonic) -> float:
    """Map a client's absolute epoch-ms deadline onto the monotonic clock, once,
    at decode time, so later comparisons are immune to wall-clock jumps."""
    return clock() + (deadline_ms / 1000.0 - time.time())


class JobFactory:
    """Turns a consumer record into a Job: decode, validate, never raise."""

    def __init__(
        self,
        inputs: ModelInputs,
        limits: LimitsConfig,
        max_record_age_ms: int = 0,
        content_type: str = MSGPACK,
    ) -> None:
        """``inputs``: the model's request inputs, which each request is checked
        against (``worker.model.inputs.bind``); ``content_type``: how a record without
        a content-type header is read (``kafka.content_type``)."""
        self._inputs = inputs
        self._max_age_ms = max_record_age_ms
        self._default_json = content_type == JSON
        self._codec_limits = Limits.of(limits)

    def __call__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        timestamp_ms: int | None = None,
        headers: Headers | None = None,
    ) -> Job:
        """``timestamp_ms``: the Kafka record's timestamp (epoch ms), which
        ``batching.max_record_age_ms`` is measured from; ``headers``: the record's
        (content type, trace context)."""
        now = time.monotonic()
        job = Job(TopicPartition(topic, partition), offset, key, arrived=now, deadline=None)
        job.timestamp_ms = timestamp_ms
        if headers:
            job.trace = parse_trace(headers)
        try:
            if self._is_json(headers):
                job.wire = "oip"
                oip = decode_oip_request(value, self._codec_limits)
                request, job.outputs_wanted = oip.request, oip.outputs
            else:
                request = decode_request(value, self._codec_limits)
            job.request = request
            self._set_deadline(job, request.deadline_ms, timestamp_ms)
            # Image files and texts stay as sent: decoded and tokenized off the
            # event loop, per batch, in the inference stage.
            job.inputs, job.lengths = self._inputs.check(request, batched=job.wire == "oip")
        except RecordError as exc:
            job.failure = exc
            job.raw_value = value
            metrics.REQUESTS_REJECTED.labels(code=exc.code).inc()
        return job

    def _is_json(self, headers: Headers | None) -> bool:
        """A record's content-type header, else ``kafka.content_type``; a content
        type the worker does not read makes the record undecodable (DLQ)."""
        for key, raw in headers or ():
            if key.lower() == "content-type":
                kind = raw.decode("ascii", "replace").split(";")[0].strip().lower()
                if kind in (JSON, MSGPACK, "application/x-msgpack"):
                    return kind == JSON
                raise UndecodableRecord(
                    f"content-type {kind[:64]!r}: the worker reads {MSGPACK} and {JSON}"
                )
        return self._default_json

    def _set_deadline(self, job: Job, deadline_ms: int | None, timestamp_ms: int | None) -> None:
        """Both rules apply; the earlier wins. Converted to the monotonic clock once,
        here, so later comparisons are immune to wall-clock jumps."""
        if deadline_ms is not None:
            job.deadline, job.expiry = epoch_ms_to_monotonic(deadline_ms), "deadline_ms"
        if self._max_age_ms > 0 and timestamp_ms is not None and timestamp_ms >= 0:
            stale_at = epoch_ms_to_monotonic(timestamp_ms + self._max_age_ms)
            if job.deadline is None or stale_at < job.deadline:
                job.deadline, job.expiry = stale_at, "max_record_age"
