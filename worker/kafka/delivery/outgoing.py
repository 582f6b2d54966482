"""What the writer sends, decided without I/O: results, DLQ records, fallbacks.

Pure functions of an answer, so every rule (which topic, which headers, what a
too-large record becomes) is unit-tested without a broker. ``AtLeastOnceWriter``
(``worker.kafka.delivery.at_least_once``) only sends what these build.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from worker import __version__
from worker.contract import (
    ErrorInfo,
    ModelInfo,
    Result,
    Tensor,
    encode_result,
)
from worker.contract.dlq import DlqHeader
from worker.contract.oip import CONTENT_TYPE as JSON
from worker.contract.oip import encode_oip_result
from worker.contract.ok_results import encode_ok_at
from worker.contract.registered import Format, ResultEncoder, ok_record
from worker.flow.codes import MAX_ERROR_MESSAGE_CHARS, ErrorCode
from worker.flow.errors import CrashLoop, InvalidRequest, UndecodableRecord
from worker.flow.messages import Answer, Job, StateChange, StepOutputs, TraceContext, Wire
from worker.kafka.changelog import encode_state

# Room for the record batch framing around one record, so a result that passes
# this check is never rejected by the producer's own size limit.
RECORD_OVERHEAD: Final = 1024

Kind = Literal["ok", "error", "dlq", "state", "step"]
# The codes a record refused by the producer or the broker is answered with.
FallbackCode = Literal[ErrorCode.TOO_LARGE, ErrorCode.INTERNAL]


class OutRecord(msgspec.Struct):
    """One record to produce for one job, kept until acknowledged so it can be
    re-sent unchanged if delivery fails. A msgspec Struct: one per answer (0.14
    us to make against 0.45 as a slotted dataclass)."""

    job: Job
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    kind: Kind
    seq: int  # send order, so redelivery keeps the original order
    request_id: str = ""
    fallback: bool = False  # already the small replacement of a refused record
    error: ErrorInfo | None = None  # why, for error results and DLQ records (logs)
    partition: int | None = None  # set: this partition (a state record's); else by key
    # The model (or pipeline, or step) that answered, and its version (Answers.records).
    model_version: str = ""
    model_name: str = ""

    @property
    def size(self) -> int:
        """Bytes the producer counts against ``max_request_size``, with framing."""
        size = len(self.value or b"") + len(self.key or b"") + RECORD_OVERHEAD
        for k, v in self.headers:
            size += len(k) + len(v)
        return size


@dataclass(frozen=True)
class Topics:
    output: str
    dlq: str
    # The output topic's registered result schemas by format (``schema_registry``): what
    # the answer of a request in a registry format is encoded with.
    registered: Mapping[Format, ResultEncoder] = field(default_factory=dict)

    def encoder(self, wire: Wire) -> ResultEncoder | None:
        """The results of a request that came in ``wire``: a registry format's."""
        if wire == "avro" or wire == "jsonschema" or wire == "protobuf":  # noqa: PLR1714 (narrows)
            return self.registered.get(wire)
        return None


def dlq_headers(job: Job, code: str, message: str, stage: str) -> list[tuple[str, bytes]]:
    return [
        (DlqHeader.ERROR_CODE, code.encode()),
        # Capped as a result's message is (in characters: a byte cut could split one).
        (DlqHeader.ERROR_MESSAGE, message[:MAX_ERROR_MESSAGE_CHARS].encode()),
        (DlqHeader.SOURCE_TOPIC, job.tp.topic.encode()),
        (DlqHeader.SOURCE_PARTITION, str(job.tp.partition).encode()),
        (DlqHeader.SOURCE_OFFSET, str(job.offset).encode()),
        (DlqHeader.STAGE, stage.encode()),
        (DlqHeader.WORKER_VERSION, __version__.encode()),
    ]


def _echo(job: Job) -> tuple[str, Mapping[str, Any] | None]:
    """The id and meta a result echoes (recovered from a failed decode, if any)."""
    if isinstance(job.failure, InvalidRequest):
        return job.failure.request_id, job.failure.meta
    if job.request is not None:
        return job.request.id, job.request.meta
    return "", None


def _timing(answer: Answer, now: float) -> dict[str, int]:
    timing = dict(answer.timing_us)
    timing["total"] = round((now - answer.job.arrived) * 1e6)
    return timing


def build_result(
    answer: Answer, model: ModelInfo, now: float, tensors: bool = True
) -> Result:
    """The wire result for one answer (never for a DLQ-bound record); ``tensors``:
    its outputs as wire tensors (not where they are encoded from the arrays)."""
    job = answer.job
    timing = _timing(answer, now)
    request_id, meta = _echo(job)
    failure = job.failure
    error = answer.error
    if failure is not None:
        error = ErrorInfo.from_error(failure)  # contract code, message length capped
    outputs = {}
    if error is None and tensors:
        assert answer.outputs is not None
        outputs = {name: Tensor.from_numpy(arr) for name, arr in answer.outputs.items()}
    return Result(
        id=request_id,
        status="ok" if error is None else "error",
        source=job.source,
        model=model,
        outputs=outputs,
        error=error,
        meta=meta,
        timing_us=timing,
        partial=answer.partial if error is None else None,
    )


def record_for(
    answer: Answer,
    model: ModelInfo,
    topics: Topics,
    seq: int,
    now: float,
    max_bytes: int,
    trace: TraceContext | None = None,
) -> OutRecord:
    """The record for one answer: an undecodable record goes to the DLQ with its
    original bytes; everything else becomes a result, in the format the request
    came in (msgpack, or Open Inference Protocol JSON). One that would exceed
    ``max_bytes`` (``kafka.max_request_size``) becomes its ``too_large`` fallback.
    ``trace``: the answer's trace context (a child span of the request's), carried
    in its headers."""
    out = _encoded(answer, model, topics, seq, now)
    if trace is not None:
        out.headers.extend(trace.headers())
    if out.size <= max_bytes:
        return out
    return fallback(out, ErrorCode.TOO_LARGE, "record exceeds kafka.max_request_size", model,
                    topics.registered)  # fmt: skip


def _encoded(answer: Answer, model: ModelInfo, topics: Topics, seq: int, now: float) -> OutRecord:
    job = answer.job
    failure = job.failure
    ok = failure is None and answer.error is None and answer.outputs is not None
    if ok and job.wire == "msgpack" and answer.partial is None:
        # The common case, on the hot path: encoded straight from the output rows
        # and the job's partition and offset (no Source built per answer).
        assert answer.outputs is not None
        request_id, meta = _echo(job)
        timing = _timing(answer, now)
        tp = job.tp
        encoded = encode_ok_at(
            request_id, answer.outputs, model, tp.topic, tp.partition, job.offset, timing, meta
        )
        return OutRecord(
            job, topics.output, job.key, encoded, [("id", request_id.encode())], "ok", seq,
            request_id=request_id,
        )  # fmt: skip
    registered = topics.encoder(job.wire)
    if ok and registered is not None and answer.partial is None:
        # As hot a path in a registry format: the envelope made without a Result.
        assert answer.outputs is not None
        request_id, meta = _echo(job)
        tp = job.tp
        record = ok_record(request_id, model.name, model.version, tp.topic, tp.partition,
                           job.offset, _timing(answer, now), meta)  # fmt: skip
        return OutRecord(
            job, topics.output, job.key, registered.encode_ok(record, answer.outputs),
            [("id", request_id.encode())], "ok", seq, request_id=request_id,
        )  # fmt: skip
    if isinstance(failure, UndecodableRecord):
        # The stage that set it aside: decoding, or the crash guard (named as its code).
        stage = ErrorCode.CRASH_LOOP if isinstance(failure, CrashLoop) else "decode"
        headers = dlq_headers(job, failure.code, str(failure), stage)
        value = job.raw_value
        if value is None and job.key is None:
            # A null-key tombstone (other clients may produce one): the producer
            # refuses a record with neither key nor value (an AssertionError, not
            # a KafkaError), which killed the worker on it at every restart.
            value = b""
        error = ErrorInfo.from_error(failure)
        return OutRecord(job, topics.dlq, job.key, value, headers, "dlq", seq, error=error)
    if job.wire == "oip":
        return _oip(answer, model, topics, seq, now)
    result = build_result(answer, model, now, tensors=registered is None)
    return OutRecord(
        job,
        topics.output,
        job.key,
        registered.encode(result, answer.outputs if ok else None) if registered is not None
        else encode_result(result),
        [("id", result.id.encode())],
        result.status,
        seq,
        request_id=result.id,
        error=result.error,
    )


def _result_value(result: Result, job: Job, topics: Topics) -> bytes:
    """A result in the request's format: a registry format's with the output
    topic's registered schema, else msgpack."""
    registered = topics.encoder(job.wire)
    return registered.encode(result) if registered is not None else encode_result(result)


def _oip(answer: Answer, model: ModelInfo, topics: Topics, seq: int, now: float) -> OutRecord:
    """An Open Inference Protocol answer: the outputs the request named (all by
    default), or an OIP error; header ``content-type: application/json``."""
    job = answer.job
    request_id, meta = _echo(job)
    error = ErrorInfo.from_error(job.failure) if job.failure is not None else answer.error
    outputs = answer.outputs
    wanted = job.outputs_wanted
    if error is None and outputs is not None and wanted is not None:
        missing = [name for name in wanted if name not in outputs]
        if missing:
            error = ErrorInfo(
                ErrorCode.INVALID_REQUEST,
                f"outputs: {', '.join(missing)[:200]} not among the answer's outputs "
                f"({', '.join(outputs)[:400]})",
            )
        else:
            outputs = {name: outputs[name] for name in wanted}
    value = encode_oip_result(
        request_id, model, job.source, _timing(answer, now), meta,
        outputs=outputs if error is None else None, error=error, partial=answer.partial,
    )  # fmt: skip
    headers = [("id", request_id.encode()), ("content-type", JSON.encode())]
    kind: Kind = "ok" if error is None else "error"
    return OutRecord(job, topics.output, job.key, value, headers, kind, seq,
                    request_id=request_id, error=error)  # fmt: skip


def fallback(
    out: OutRecord, code: FallbackCode, reason: str, model: ModelInfo,
    registered: Mapping[Format, ResultEncoder] | None = None,
) -> OutRecord:  # fmt: skip
    """A small record for what could not be produced as it is (too large for
    the producer, or refused for good by the broker): results become a ``code``
    error result without outputs or meta; DLQ records keep their headers but not
    the value, which is noted in a header. Stage ``produce`` either way. The
    record's trace context goes with it whatever it becomes: a failure is what a
    trace is most often read for."""
    job = out.job
    trace = [h for h in out.headers if h[0] in ("traceparent", "tracestate")]
    if out.kind == "dlq":
        headers = dlq_headers(job, code, f"{reason}; original value omitted", "produce")
        headers.append((DlqHeader.VALUE_OMITTED_BYTES, str(len(out.value or b"")).encode()))
        headers += trace
        # b"" rather than None: a record needs a key or a value.
        return OutRecord(
            job, out.topic, out.key, b"", headers, "dlq", out.seq,
            request_id=out.request_id, fallback=True, error=ErrorInfo(code, reason),
        )  # fmt: skip
    error = ErrorInfo(code, f"{reason} (stage produce)")
    if job.wire == "oip":
        value = encode_oip_result(out.request_id, model, job.source, {}, None, error=error)
        headers = [("id", out.request_id.encode()), ("content-type", JSON.encode()), *trace]
        return OutRecord(job, out.topic, out.key, value, headers, "error", out.seq,
                        request_id=out.request_id, fallback=True, error=error)  # fmt: skip
    result = Result(
        id=out.request_id,
        status="error",
        source=job.source,
        model=model,
        error=error,
    )
    return OutRecord(
        job,
        out.topic,
        out.key,
        _result_value(result, job, Topics(out.topic, "", registered or {})),
        [("id", out.request_id.encode()), *trace],
        "error",
        out.seq,
        request_id=out.request_id,
        fallback=True,
        error=result.error,
    )


def state_record(job: Job, change: StateChange, topic: str, seq: int) -> OutRecord:
    """A stateful model's sequence after ``job``, for the state changelog
    (``kafka.changelog``): on the input's partition number, keyed by the sequence.
    Marked ``fallback``: a state the broker refuses for good has no smaller
    replacement, and stops the worker (``decide``: give up)."""
    value = encode_state(job, change)
    return OutRecord(job, topic, job.key, value, [], "state", seq, fallback=True,
                     partition=job.tp.partition)  # fmt: skip


def step_record(
    job: Job, step: StepOutputs, version: str, request_id: str, seq: int
) -> OutRecord:
    """A pipeline step's outputs for ``job``, for the step's own topic: a result
    message (contract v1) named ``PIPELINE/STEP``, keyed and sourced as the request.
    Marked ``fallback``, as a state record: refused for good, it stops the worker
    rather than leave a gap in the audit (``decide``: give up)."""
    outputs = {name: Tensor.from_numpy(arr) for name, arr in step.outputs.items()}
    result = Result(id=request_id, status="ok", source=job.source,
                    model=ModelInfo(step.step, version), outputs=outputs)  # fmt: skip
    headers = [("id", request_id.encode()), ("step", step.step.encode())]
    return OutRecord(job, step.topic, job.key, encode_result(result), headers, "step", seq,
                     request_id=request_id, fallback=True)  # fmt: skip
