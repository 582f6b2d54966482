"""``infer-worker produce`` and ``infer-worker consume``: send requests, see answers.

For a person at a terminal, not for throughput: ``produce`` sends image files
(JPEG, PNG or WebP as they are; ``.npy`` arrays as tensors), texts, or samples
of a bundled model (digits, sentiment), each with a fresh unique id, and by
default waits for their answers and prints them. ``consume`` prints results as
they arrive.

Results are found by id (the ``id`` header), reading the output and DLQ topics
from the beginning without a consumer group: nothing is committed, no worker's
group is disturbed, and no answer produced before the reader started is missed
(the embedded broker cannot seek to the end reliably; see DESIGN's broker notes).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from aiokafka import AIOKafkaProducer

from worker.config import KafkaConfig, LimitsConfig, SchemaRegistryConfig
from worker.contract import Result, decode_request
from worker.contract.dlq import DlqHeader
from worker.contract.oip import CONTENT_TYPE as JSON
from worker.contract.oip_client import encode_oip_request
from worker.contract.registered import Format
from worker.flow.deadline import Deadline
from worker.flow.errors import ConfigError
from worker.kafka.clients import started
from worker.kafka.credentials import connection
from worker.kafka.diagnose import run_tool
from worker.kafka.registry_requests import RequestEncoder
from worker.kafka.registry_results import RegistryResults
from worker.kafka.topiccheck import existing_topics, require_topics
from worker.ops.requests import (
    OUTPUT_LABELS,
    LabelledRequest,
    cycled,
    from_file,
    from_named_files,
    from_samples,
    from_text,
    with_meta,
)
from worker.ops.topics import Collected, Collector

# Room for the request envelope around the largest image the worker accepts.
_ENVELOPE = 64 * 1024


# Up to this many requests are printed one line each as they are sent; more are
# a backlog or a stream, reported by a progress line a second.
_LINE_EACH = 20
# Records handed to the producer and not yet acknowledged, at most: memory stays
# bounded however many are sent, and the producer still batches.
_IN_FLIGHT = 1000


async def send(
    kafka: KafkaConfig,
    topic: str,
    requests: Iterable[LabelledRequest],
    max_bytes: int,
    oip: bool = False,
    *,
    total: int | None = None,
    rate: float = 0.0,
    setting: str = "--topic",
    registry: RequestEncoder | None = None,
) -> int:
    """Send ``requests`` (``total`` of them, when known, for the progress line),
    at most ``rate`` a second when > 0, each acknowledged by the broker before
    this returns; with ``oip``, as Open Inference Protocol JSON (header
    ``content-type: application/json``) instead of msgpack; with ``registry``, in
    its Schema Registry format. The topic is checked
    first: a missing one is a ``ConfigError`` naming ``setting``, not a wait on
    metadata that ends as "no broker answers". Returns how many were sent."""
    producer = AIOKafkaProducer(
        **connection(kafka), acks="all", max_request_size=max_bytes, linger_ms=5
    )
    await started(producer)
    try:
        require_topics(setting, [topic], await existing_topics(producer.client), kafka)
        each = total is not None and total <= _LINE_EACH
        pending: deque[asyncio.Future[Any]] = deque()
        start = last = time.monotonic()
        sent = 0
        for r in requests:
            if rate > 0:
                delay = start + sent / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            value = (encode_oip_request(decode_request(r.value)) if oip
                     else registry.encode(decode_request(r.value)) if registry is not None
                     else r.value)  # fmt: skip
            headers = [("content-type", JSON.encode())] if oip else []
            pending.append(await producer.send(topic, value, key=r.id.encode(), headers=headers))
            while len(pending) > _IN_FLIGHT or (pending and pending[0].done()):
                await pending.popleft()
            sent += 1
            if each:
                print(f"sent {r.id}  ({r.label})", file=sys.stderr)
            elif time.monotonic() - last >= 1.0:
                last = time.monotonic()
                print(_progress(sent, total, last - start), file=sys.stderr)
        while pending:
            await pending.popleft()
        if not each:
            print(_progress(sent, total, time.monotonic() - start, done=True), file=sys.stderr)
        return sent
    finally:
        await producer.stop()


def _progress(sent: int, total: int | None, seconds: float, done: bool = False) -> str:
    of = f" of {total:,}" if total is not None and not done else ""
    rate = f"{sent / seconds:,.0f}/s" if seconds > 0 else "-"
    return f"{'sent' if done else 'sending'} {sent:,}{of} requests in {seconds:.1f} s ({rate})"


def describe(result: Result) -> str:
    """One line for a person: the top classes, or the error."""
    if result.status != "ok" or result.error is not None:
        code, message = (result.error.code, result.error.message) if result.error else ("?", "")
        return f"{result.id}  error {code}: {message}"
    parts = []
    if "topk_indices" in result.outputs and "topk_scores" in result.outputs:
        idx = result.outputs["topk_indices"].to_numpy().ravel()
        scores = result.outputs["topk_scores"].to_numpy().ravel()
        parts.append(
            "top: " + ", ".join(f"{i} ({s:.3f})" for i, s in zip(idx, scores, strict=True))
        )
    else:
        parts.append("outputs: " + ", ".join(
            _output(result.model.name, k, t.to_numpy()) for k, t in result.outputs.items()
        ))  # fmt: skip
    total = result.timing_us.get("total")
    if total is not None:
        parts.append(f"in {total / 1000:.1f} ms")
    return f"{result.id}  ok  " + "  ".join(parts)


def _output(model: str, name: str, value: np.ndarray) -> str:
    """An output as its dtype and shape, and, where the bundled model's classes
    are known (``OUTPUT_LABELS``), the class it picks."""
    text = f"{name} {value.dtype}{list(value.shape)}"
    labels = OUTPUT_LABELS.get(model, {}).get(name)
    if labels is not None and value.size == len(labels):
        text += f" = {labels[int(np.argmax(value))]}"
    return text


def as_json(result: Result) -> str:
    outputs = {k: t.to_numpy().tolist() for k, t in result.outputs.items()}
    error = (
        None
        if result.error is None
        else {"code": result.error.code, "message": result.error.message}
    )
    return json.dumps({
        "id": result.id, "status": result.status, "outputs": outputs, "error": error,
        "model": vars(result.model), "source": msgspec.structs.asdict(result.source),
        "timing_us": dict(result.timing_us), "meta": result.meta,
    })  # fmt: skip


def _dlq_line(rec: Collected) -> str:
    h = rec.headers
    code = h.get(DlqHeader.ERROR_CODE, b"?").decode(errors="replace")
    message = h.get(DlqHeader.ERROR_MESSAGE, b"").decode(errors="replace")
    where = "/".join(h.get(k, b"?").decode()
                     for k in (DlqHeader.SOURCE_TOPIC, DlqHeader.SOURCE_PARTITION))  # fmt: skip
    offset = h.get(DlqHeader.SOURCE_OFFSET, b"?").decode()
    return f"(dlq) {where}@{offset}  {code}: {message}"


async def watch(
    kafka: KafkaConfig,
    *,
    ids: set[str] | None,
    timeout: float | None,
    json_lines: bool,
    include_dlq: bool = True,
    registry: RegistryResults | None = None,
) -> Watched:
    """Print results (of ``ids`` only, when given) as they arrive, until each
    of ``ids`` is answered or ``timeout``; ``registry``: reads results in a
    Schema Registry format."""
    topics = [kafka.output_topic] + ([kafka.dlq_topic] if include_dlq else [])
    collector = Collector(connection(kafka), topics, registry=registry)
    await collector.start()
    wanted = set(ids or ())
    seen: set[str] = set()
    errors: set[str] = set()

    def show(c: Collector) -> None:
        for topic, bucket in c.records.items():
            for rec in bucket:
                _show(topic, rec)
            bucket.clear()

    def _show(topic: str, rec: Collected) -> None:
        rid = rec.headers.get("id", b"").decode(errors="replace")
        if topic == kafka.dlq_topic and topic != kafka.output_topic:
            if not wanted:  # a DLQ record has no id to match a request by
                print(_dlq_line(rec), flush=True)
            return
        if wanted and rid not in wanted:
            return
        try:
            result = rec.result()
        except Exception as exc:  # boundary: a foreign or corrupt record on the topic
            print(f"(unreadable record at {topic}/{rec.partition}@{rec.offset}: {exc})")
            return
        seen.add(result.id)
        if result.status == "error":
            errors.add(result.id)
        print(as_json(result) if json_lines else describe(result), flush=True)

    def done(_: Collector) -> bool:
        return bool(wanted) and wanted <= seen

    try:
        budget = Deadline(timeout if timeout is not None else float("inf"))
        while not done(collector) and not budget.expired:
            step = min(1.0, budget.left())
            await collector.collect(done, step, progress=show)
            show(collector)
    finally:
        await collector.stop()
    missing = wanted - seen
    for rid in sorted(missing):
        print(f"{rid}  no answer within {timeout:g} s", file=sys.stderr)
    return Watched(len(missing), len(errors & wanted) if wanted else len(errors))


@dataclass(frozen=True)
class Watched:
    """What ``watch`` saw: requests of ``ids`` not answered in time, and answers
    that were errors."""

    missing: int
    errors: int


def request_size(limits: LimitsConfig) -> int:
    """The producer's request size for the largest request the worker takes."""
    return max(limits.max_record_bytes, limits.max_tensor_bytes + _ENVELOPE)


def run_produce(
    kafka: KafkaConfig,
    limits: LimitsConfig,
    files: Sequence[str],
    samples: int,
    wait: bool,
    timeout: float,
    json_lines: bool,
    *,
    topic: str | None = None,
    texts: Sequence[str] = (),
    input_name: str | None = None,
    sample_model: str = "digits",
    oip: bool = False,
    meta: Mapping[str, Any] | None = None,
    count: int | None = None,
    rate: float = 0.0,
    model_name: str | None = None,
    model_version: str | None = None,
    named: Mapping[str, Path] | None = None,
    allow_errors: bool = False,
    registry: SchemaRegistryConfig | None = None,
    registry_format: Format = "avro",
) -> int:
    """Send the files, texts and samples given (cycled to ``count`` requests when
    set, ``rate`` a second when > 0) to ``topic`` (default: the configuration's
    first input topic), then, with ``wait``, print each answer as it arrives;
    ``model_name``: the model each request names (several models in one worker);
    ``named``: one more request of these named inputs; ``registry``: the requests
    in ``registry_format`` of that Schema Registry, their answers read with it.
    Exit status 1 when an answer did not come in time, or came as an error
    (unless ``allow_errors``)."""
    if rate < 0:
        raise ConfigError(f"--rate must be >= 0 (requests a second; 0 = as fast as acked), "
                          f"got {rate:g}")  # fmt: skip
    if model_version is not None and model_name is None:
        raise ConfigError("--model-version names a version of the model --model-name names")
    requests = [from_file(Path(f), limits, input_name or "image") for f in files]
    requests += [from_text(t, input_name or "text") for t in texts]
    requests += from_samples(samples, sample_model)
    if named:
        requests.append(from_named_files(named, limits))
    requests = with_meta(requests, meta or {}, model_name, model_version)
    if not requests:
        raise ConfigError("nothing to send: give image files, --text TEXT, --input NAME=FILE "
                          "or --samples N")
    total = len(requests) if count is None else count
    stream = iter(requests) if count is None else cycled(requests, count)
    ids: set[str] = set()

    def noted(rs: Iterable[LabelledRequest]) -> Iterable[LabelledRequest]:
        for r in rs:
            if wait:
                ids.add(r.id)
            yield r

    target = topic or kafka.input_topics[0]
    setting = "--topic" if topic else "kafka.input_topics"

    encoder = RequestEncoder(registry, registry_format, target) if registry else None
    reader = RegistryResults(registry) if registry else None

    async def go() -> int:
        await send(kafka, target, noted(stream), request_size(limits), oip, total=total,
                   rate=rate, setting=setting, registry=encoder)  # fmt: skip
        if not wait:
            return 0
        seen = await watch(kafka, ids=ids, timeout=timeout, json_lines=json_lines,
                           include_dlq=False, registry=reader)  # fmt: skip
        if seen.errors and not allow_errors:
            print(f"{seen.errors} of {len(ids)} answered with an error", file=sys.stderr)
        return 1 if seen.missing or (seen.errors and not allow_errors) else 0

    return run_tool(kafka, go())


def run_consume(
    kafka: KafkaConfig, ids: Sequence[str], timeout: float | None, json_lines: bool,
    registry: RegistryResults | None = None,
) -> int:  # fmt: skip
    seen = run_tool(kafka, watch(kafka, ids=set(ids) or None, timeout=timeout,
                                 json_lines=json_lines, registry=registry))  # fmt: skip
    return 1 if seen.missing else 0


__all__: list[str] = [
    "describe",
    "from_file",
    "from_samples",
    "run_consume",
    "run_produce",
    "watch",
]
