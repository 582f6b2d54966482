"""W3C trace context from request to answer, and, optionally, a span per request.

A request record's ``traceparent`` header (W3C Trace Context:
``00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>``) and its
``tracestate`` are carried to the request's result or DLQ record as a child of
the request's span: the same trace id, a new span id, the same flags and state.
A consumer of the results continues the trace from there. A malformed header
is ignored (the spec's rule: start a new trace rather than fail the request).

With ``tracing.enabled`` the worker also emits that child span through the
OpenTelemetry SDK (the ``tracing`` extra; OTLP over HTTP): one span per request,
from the record's arrival to its answer being sent, with the stages as events
(``queue``, ``decode``, ``preprocess``, ``infer``, ``produce``) and the batch
size, topic, partition and offset as attributes; a request without a trace
context gets a new trace. Without it nothing of OpenTelemetry is imported, and
requests without a ``traceparent`` header cost nothing.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from typing import Any, Final

from worker.flow.errors import ConfigError
from worker.flow.messages import Answer, TraceContext
from worker.flow.values import ErrorInfo

_PARENT: Final = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
ZERO_TRACE: Final = "0" * 32
ZERO_SPAN: Final = "0" * 16


def parse(headers: Sequence[tuple[str, bytes]] | None) -> TraceContext | None:
    """The trace context of a record's headers, or None (absent or malformed)."""
    if not headers:
        return None
    parent = state = None
    for key, value in headers:
        if key == "traceparent":
            parent = value
        elif key == "tracestate":
            state = value
    if parent is None:
        return None
    found = _PARENT.match(parent.decode("ascii", "replace").strip().lower())
    if found is None:
        return None
    version, trace_id, parent_id, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == ZERO_TRACE:
        return None
    if parent_id == ZERO_SPAN:
        return None
    return TraceContext(trace_id, parent_id, flags, state)


def new_span_id() -> str:
    while (span := os.urandom(8).hex()) == ZERO_SPAN:
        pass
    return span


class Tracer:
    """Span ids for answers; emits nothing (the default: tracing.enabled false)."""

    exporting = False

    def span(
        self,
        ctx: TraceContext | None,
        attributes: dict[str, Any],
        events: Sequence[tuple[str, float]],
        start_ns: int,
        end_ns: int,
    ) -> TraceContext | None:
        """The context an answer's headers carry: a new span, child of ``ctx``, is
        its ``parent_id`` (None: no context to carry)."""
        if ctx is None:
            return None
        return TraceContext(ctx.trace_id, new_span_id(), ctx.flags, ctx.state)

    def close(self) -> None:
        pass


class OtelTracer(Tracer):
    """Emits one span per request through the OpenTelemetry SDK (OTLP/HTTP)."""

    exporting = True

    def __init__(self, service_name: str, endpoint: str, sample_ratio: float = 1.0) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        except ImportError as exc:
            raise ConfigError(
                "tracing.enabled: needs the OpenTelemetry SDK: pip install -e '.[tracing]'"
            ) from exc
        self._trace = trace
        # Parent-based: the caller's sampled flag decides; roots by ratio.
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("infer-worker")
        self._open = True

    def span(
        self,
        ctx: TraceContext | None,
        attributes: dict[str, Any],
        events: Sequence[tuple[str, float]],
        start_ns: int,
        end_ns: int,
    ) -> TraceContext | None:
        trace = self._trace
        parent = None
        if ctx is not None:
            remote = trace.SpanContext(
                trace_id=int(ctx.trace_id, 16), span_id=int(ctx.parent_id, 16), is_remote=True,
                trace_flags=trace.TraceFlags(int(ctx.flags, 16)),
            )  # fmt: skip
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        span = self._tracer.start_span(
            "infer", context=parent, kind=trace.SpanKind.CONSUMER, start_time=start_ns,
            attributes=attributes,
        )  # fmt: skip
        for name, at_ns in events:
            span.add_event(name, timestamp=int(at_ns))
        span.end(end_time=end_ns)
        sc = span.get_span_context()
        return TraceContext(
            f"{sc.trace_id:032x}", f"{sc.span_id:016x}", f"{int(sc.trace_flags):02x}",
            ctx.state if ctx is not None else None,
        )  # fmt: skip

    def close(self) -> None:
        """Export what is buffered (shutdown; once, however often it is called)."""
        if self._open:
            self._open = False
            self._provider.shutdown()


def wall_ns(monotonic: float) -> int:
    """Epoch nanoseconds of a monotonic instant of this process (span times)."""
    return time.time_ns() - round((time.monotonic() - monotonic) * 1e9)


def answer_span(
    tracer: Tracer, answer: Answer, model: str, batch_size: int, now: float
) -> TraceContext | None:
    """The answer's span, a child of the request's: from the record's arrival to
    ``now`` (monotonic), its stages as events at their ends (from the answer's
    timings), where it came from and how it ended as attributes."""

    job = answer.job
    if not tracer.exporting:  # only the child context is carried: nothing to record
        return tracer.span(job.trace, {}, (), 0, 0)
    start = wall_ns(job.arrived)
    events: list[tuple[str, float]] = []
    at = start
    for stage in ("queue", "decode", "preprocess", "infer", "d2h"):
        if stage in answer.timing_us:
            at += answer.timing_us[stage] * 1000
            events.append((stage, float(at)))
    end = wall_ns(now)
    events.append(("produce", float(end)))
    error = answer.error or (ErrorInfo.from_error(job.failure) if job.failure else None)
    attributes: dict[str, Any] = {
        "messaging.system": "kafka",
        "messaging.source.name": job.tp.topic,
        "messaging.kafka.source.partition": job.tp.partition,
        "messaging.kafka.message.offset": job.offset,
        "infer.batch_size": batch_size,
        "infer.model": model,
        "infer.status": "error" if error is not None else "ok",
    }
    if error is not None:
        attributes["infer.error_code"] = error.code
    return tracer.span(job.trace, attributes, events, start, end)
