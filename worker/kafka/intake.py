"""Intake: one consumer record in, one ``Job`` out: decode, validate, never raise.

Records are decoded and validated here, before any engine work: a record that
fails becomes a ``Job`` carrying its failure, and still flows through the
pipeline in order, so per-partition result order equals request order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from worker.config import LimitsConfig
from worker.config.models import Routing
from worker.contract import Limits, decode_request
from worker.contract.oip import CONTENT_TYPE as JSON
from worker.contract.oip import MSGPACK, decode_oip_request
from worker.contract.registered import InputsView, RequestSchema, request_of, schema_id
from worker.flow.drain import Shares
from worker.flow.errors import RecordError, UndecodableRecord
from worker.flow.messages import ExpiryRule, Job, TopicPartition, Wire
from worker.flow.values import Request
from worker.kafka.registry import Schemas
from worker.model.inputs import ModelInputs
from worker.model.inputs.image import BoundImage
from worker.model.inputs.tensor import BoundTensor
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
        model: str = "",
        *,
        routing: Routing | None = None,
        others: Mapping[str, tuple[ModelInputs, LimitsConfig]] | None = None,
        schemas: Schemas | None = None,
        shares: Shares | None = None,
    ) -> None:
        """``inputs``: the request inputs of ``model`` (its name, which its jobs
        carry: ``Job.model``), which each request is checked against
        (``worker.model.inputs.bind``); ``content_type``: how a record without a
        content-type header is read (``kafka.content_type``). Several models and
        pipelines: ``routing`` decides each request's answerer, and ``others``
        holds every other answerer's inputs and limits; a record is decoded
        within the widest limits, then checked against its answerer's inputs.
        ``schemas``: the Schema Registry's request schemas (``schema_registry``),
        which a record in the registry's format (Avro) is read with. ``shares``:
        counts each shared topic's records by the model they went to, the split
        of its backlog (``worker.flow.drain``)."""
        self._max_age_ms = max_record_age_ms
        self._default_json = content_type == JSON
        self.model = model
        self._routing = routing or Routing.one(model)
        self._shared = self._routing.shared
        self.shares = shares if shares is not None else Shares()
        self._inputs = {model: inputs, **{n: i for n, (i, _) in (others or {}).items()}}
        self.schemas = schemas
        self._views = {name: _view(i) for name, i in self._inputs.items()} if schemas else {}
        every = [Limits.of(limits), *(Limits.of(x) for _, x in (others or {}).values())]
        self._codec_limits = Limits(
            max_record_bytes=max(x.max_record_bytes for x in every),
            max_tensor_bytes=max(x.max_tensor_bytes for x in every),
            max_text_bytes=max(x.max_text_bytes for x in every),
        )

    def __call__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        timestamp_ms: int | None = None,
        headers: Headers | None = None,
        epoch: int = 0,
    ) -> Job:
        """``timestamp_ms``: the Kafka record's timestamp (epoch ms), which
        ``batching.max_record_age_ms`` is measured from; ``headers``: the record's
        (content type, trace context); ``epoch``: its partition's tracker epoch."""
        now = time.monotonic()
        trace = parse_trace(headers) if headers else None
        wire: Wire = "msgpack"
        request: Request | None = None
        outputs_wanted: tuple[str, ...] | None = None
        inputs: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        deadline: float | None = None
        expiry: ExpiryRule | None = None
        failure: RecordError | None = None
        model = self._routing.owner(topic)  # a record failing before it names one: its topic's
        try:
            sid = schema_id(value) if value is not None and value[:1] == b"\x00" else None
            if sid is not None:
                schema = self._schema(sid)
                wire = schema.format  # its answer, an error's too, in the request's format
                request = self._registered(topic, value or b"", schema)
            elif self._is_json(headers):
                wire = "oip"
                oip = decode_oip_request(value, self._codec_limits)
                request, outputs_wanted = oip.request, oip.outputs
            else:
                request = decode_request(value, self._codec_limits)
            deadline, expiry = self._deadline(request.deadline_ms, timestamp_ms)
            named = None if request.model is None else request.model.name
            # The one decision of which model or pipeline answers (its version, if
            # pinned, is checked where the batch runs: worker.compute.triage).
            model = self._routing.answerer(topic, named, request_id=request.id,
                                           meta=request.meta)  # fmt: skip
            # Image files and texts stay as sent: decoded and tokenized off the
            # event loop, per batch, in the inference stage.
            inputs, lengths = self._inputs[model].check(request, batched=wire == "oip")
        except RecordError as exc:
            failure = exc  # counted once answered (``Answers.records``)
        if topic in self._shared:  # a failed record too: its topic's owner answers it
            self.shares.count(topic, model)
        return Job(
            TopicPartition(topic, partition), offset, key, arrived=now, deadline=deadline,
            request=request, inputs=inputs, lengths=lengths, failure=failure,
            raw_value=value if failure is not None else None, epoch=epoch, expiry=expiry,
            timestamp_ms=timestamp_ms, wire=wire, outputs_wanted=outputs_wanted, trace=trace,
            model=model,
        )  # fmt: skip

    def admit(self, model: str, inputs: ModelInputs, limits: LimitsConfig) -> None:
        """A model the control topic brought: its requests checked against
        ``inputs``, decoded within ``limits`` too (the routing table, shared,
        has grown already)."""
        self._inputs[model] = inputs
        if self.schemas is not None:
            self._views[model] = _view(inputs)
        mine = Limits.of(limits)
        self._codec_limits = Limits(
            max_record_bytes=max(self._codec_limits.max_record_bytes, mine.max_record_bytes),
            max_tensor_bytes=max(self._codec_limits.max_tensor_bytes, mine.max_tensor_bytes),
            max_text_bytes=max(self._codec_limits.max_text_bytes, mine.max_text_bytes),
        )

    def _schema(self, sid: int) -> RequestSchema:
        """The request schema of id ``sid`` (fetched before: ``Schemas.ready``)."""
        if self.schemas is None:
            raise UndecodableRecord(f"a Schema Registry record (schema id {sid}): this worker "
                                    "has no schema_registry.url")  # fmt: skip
        return self.schemas.get(sid)

    def _registered(self, topic: str, value: bytes, schema: RequestSchema) -> Request:
        """A record in a Schema Registry format, read with its schema as the model
        it names (or its topic's) takes it. The codecs are other libraries' code
        on bytes a client chose: anything else they raise sends the record to the
        DLQ with the reason, never stops the worker."""
        try:
            record = schema.read(value)
        except RecordError:
            raise
        except Exception as exc:  # boundary: fastavro's, jsonschema's, protobuf's
            raise UndecodableRecord(f"schema {schema.schema_id}: {type(exc).__name__}: "
                                    f"{str(exc)[:200]}") from exc  # fmt: skip
        named = record.get("model")
        rid = record.get("id")
        model = self._routing.answerer(
            topic, named if isinstance(named, str) else None,
            request_id=rid if isinstance(rid, str) else "", meta=None,
        )  # fmt: skip
        return request_of(record, schema, self._views[model])

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

    def _deadline(
        self, deadline_ms: int | None, timestamp_ms: int | None
    ) -> tuple[float | None, ExpiryRule | None]:
        """Both rules apply; the earlier wins. Converted to the monotonic clock once,
        here, so later comparisons are immune to wall-clock jumps."""
        deadline: float | None = None
        expiry: ExpiryRule | None = None
        if deadline_ms is not None:
            deadline, expiry = epoch_ms_to_monotonic(deadline_ms), "deadline_ms"
        if self._max_age_ms > 0 and timestamp_ms is not None and timestamp_ms >= 0:
            stale_at = epoch_ms_to_monotonic(timestamp_ms + self._max_age_ms)
            if deadline is None or stale_at < deadline:
                deadline, expiry = stale_at, "max_record_age"
        return deadline, expiry


def _view(inputs: ModelInputs) -> InputsView:
    """What an Avro request's fields become, by the answerer's inputs."""
    images = frozenset(k.name for k in inputs.kinds if isinstance(k, BoundImage))
    fixed = {k.name: (k.desc.dtype.name, k.desc.fixed_shape)
             for k in inputs.kinds if isinstance(k, BoundTensor) and k.desc.fixed}
    return InputsView(frozenset(k.name for k in inputs.kinds), images, fixed)
