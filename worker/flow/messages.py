"""What flows between the stages, in one place; frozen, so a stage hands on a new
value instead of changing one another stage holds.

    consume -> Job -> batching -> Batch[Job] -> inference -> Completed(Answer...)
        -> produce -> offsets

Every stage imports its input and output types from here, never from the stage
that makes them, so a later stage never imports an earlier one. These are plain
containers: no I/O, no behaviour beyond what describes the data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeVar

import msgspec
import numpy as np

from worker.flow.errors import RecordError
from worker.flow.values import ErrorInfo, Request, Source

ExpiryRule = Literal["deadline_ms", "max_record_age"]
Wire = Literal["msgpack", "oip", "avro", "jsonschema", "protobuf"]


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The request's trace context: its trace id, its span (our parent), flags,
    and ``tracestate`` as sent (vendor data, passed on untouched)."""

    trace_id: str
    parent_id: str
    flags: str
    state: bytes | None = None

    def headers(self) -> list[tuple[str, bytes]]:
        """The record headers that carry this context (``parent_id`` is the span a
        reader of the record continues from)."""
        headers = [("traceparent", f"00-{self.trace_id}-{self.parent_id}-{self.flags}".encode())]
        if self.state is not None:
            headers.append(("tracestate", self.state))
        return headers


class TopicPartition(NamedTuple):
    """Hashable and cheap; aiokafka's own type is converted at the consumer edge."""

    topic: str
    partition: int


class Job(msgspec.Struct, frozen=True):
    """One input record on its way through the pipeline: made once, by the intake,
    and never changed after (a stage that needs another value makes a new one,
    ``msgspec.structs.replace``). A msgspec Struct, not a dataclass: made per
    record, and a frozen dataclass of this many fields costs 3.7 us to build
    against 0.27 us (issue 36)."""

    tp: TopicPartition
    offset: int
    key: bytes | None
    arrived: float  # monotonic, when the worker read it
    deadline: float | None  # monotonic: the earlier of deadline_ms and the record-age limit
    request: Request | None = None
    # The request's inputs once validated, by request input name, as sent: an
    # image's uint8 [H, W, C] view or its file, a tensor's array, a text. The
    # inference stage prepares them (decodes files, tokenizes) into its own rows.
    inputs: Mapping[str, Any] = msgspec.field(default_factory=dict)
    # Lengths of the request's free dimensions known at intake, by the model's
    # symbol for them (``worker.model.io``; a text's are known once tokenized).
    lengths: Mapping[str, int] = msgspec.field(default_factory=dict)
    failure: RecordError | None = None  # answered without inference when set
    raw_value: bytes | None = None  # kept only for DLQ records (original bytes)
    epoch: int = 0  # the tracker epoch of its partition when read (stale if it changed)
    expiry: ExpiryRule | None = None  # which rule set ``deadline``
    timestamp_ms: int | None = None  # the Kafka record's timestamp (wall clock, epoch ms)
    # How it came and is answered: msgpack (contract v1), Open Inference Protocol
    # JSON ("oip", ``worker.contract.oip``), which may name the outputs it wants, or a
    # Schema Registry format ("avro", "jsonschema", "protobuf": ``contract.registered``).
    wire: Wire = "msgpack"
    outputs_wanted: tuple[str, ...] | None = None
    trace: TraceContext | None = None  # the record's W3C trace context, if it had one
    # The model that answers it (several models in one worker: its topic's, or the
    # one its request names); "": the worker's only model.
    model: str = ""

    @property
    def source(self) -> Source:
        return Source(topic=self.tp.topic, partition=self.tp.partition, offset=self.offset)


class Batchable(Protocol):
    """What the batching policy needs of an item (``Job`` has it)."""

    @property
    def arrived(self) -> float: ...  # monotonic seconds

    @property
    def deadline(self) -> float | None: ...  # monotonic seconds, if the request has one


T = TypeVar("T", bound=Batchable)
FlushReason = Literal["full", "preferred", "delay", "deadline", "drain"]


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    items: list[T]
    formed_at: float  # monotonic
    reason: FlushReason
    seq: int = 0

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True, slots=True)
class StateChange:
    """A stateful model's sequence (the job's key) after the job was answered:
    its next state by state input, or None when the sequence ended. What the
    writer records in the state changelog (``kafka.state_topic``)."""

    values: Mapping[str, np.ndarray] | None


class StepOutputs(msgspec.Struct, frozen=True):
    """A pipeline step's outputs for one request, also written to a topic of the
    step's own (``[[pipelines.NAME.steps]] topic``: audit and replay)."""

    topic: str
    step: str  # named in the record as "PIPELINE/STEP"
    outputs: Mapping[str, np.ndarray]


class Answer(msgspec.Struct, frozen=True):
    """The outcome for one job: outputs (one row of each batch output) or an error,
    and the time each stage took (``timing_us``); for a stateful model, what
    became of its sequence's state. Made per record: a Struct, like ``Job``."""

    job: Job
    outputs: Mapping[str, np.ndarray] | None = None
    error: ErrorInfo | None = None
    timing_us: Mapping[str, int] = msgspec.field(default_factory=dict)
    state: StateChange | None = None
    steps: tuple[StepOutputs, ...] = ()  # a pipeline's steps' outputs bound for their topics
    # A pipeline's answer without every step: what did not run and why (``Result.partial``).
    partial: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Completed:
    """One batch's answers, in the batch's order."""

    seq: int
    answers: tuple[Answer, ...]
    engine_rows: int  # requests that actually went through the engine
    service_s: float = 0.0  # preprocess + compute of the batch (feeds the batch policy)
    # The model version that answered (a model swapped while the worker runs:
    # worker.app.reload); None: the one the worker started with.
    model_version: str | None = None
