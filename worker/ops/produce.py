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

import json
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from aiokafka import AIOKafkaProducer

from worker.config import KafkaConfig, LimitsConfig
from worker.contract import (
    EncodedImage,
    Request,
    Result,
    Tensor,
    decode_request,
    decode_result,
    encode_request,
    sniff_format,
)
from worker.contract.dlq import DlqHeader
from worker.contract.oip import CONTENT_TYPE as JSON
from worker.contract.oip import decode_oip_result, encode_oip_request
from worker.flow.deadline import Deadline
from worker.flow.errors import ConfigError
from worker.kafka.clients import started
from worker.kafka.credentials import connection
from worker.kafka.diagnose import run_tool
from worker.ops.topics import Collected, Collector

# Room for the request envelope around the largest image the worker accepts.
_ENVELOPE = 64 * 1024


@dataclass(frozen=True)
class LabelledRequest:
    id: str
    label: str  # what the person asked for: a file name or "sample 3 (a 7)"
    value: bytes


def with_meta(
    requests: Sequence[LabelledRequest], meta: Mapping[str, Any]
) -> list[LabelledRequest]:
    """``requests`` with ``meta`` added to each one's (``produce --meta``: a label
    ``compare --label-key`` reads, a trace id, anything the results should echo)."""
    if not meta:
        return list(requests)
    out = []
    for r in requests:
        request = decode_request(r.value)
        merged = {**(request.meta or {}), **meta}
        value = encode_request(msgspec.structs.replace(request, meta=merged))
        out.append(LabelledRequest(r.id, r.label, value))
    return out


def parse_meta(items: Sequence[str]) -> dict[str, Any]:
    """``key=value`` pairs; a value that reads as JSON (a number, true, a list)
    is sent as that, anything else as a string (``label=7`` is the int 7)."""
    meta: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--meta {item!r}: expected key=value")
        try:
            meta[key.strip()] = json.loads(text)
        except ValueError:
            meta[key.strip()] = text
    return meta


def from_file(path: Path, limits: LimitsConfig, input_name: str = "image") -> LabelledRequest:
    """A request for one file: image files as sent, ``.npy`` as a tensor (any
    dtype the contract carries: the worker checks it against the model)."""
    rid = f"{path.stem}-{uuid.uuid4().hex[:8]}"
    if path.suffix.lower() == ".npy":
        array = np.load(path, allow_pickle=False)
        try:
            image: Tensor | EncodedImage = Tensor.from_numpy(array)
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    else:
        data = path.read_bytes()
        fmt = sniff_format(data)
        if fmt is None:
            raise ConfigError(f"{path}: not a JPEG, PNG or WebP file (or a .npy array)")
        if len(data) > limits.max_tensor_bytes:
            raise ConfigError(
                f"{path}: {len(data)} bytes; the worker takes files up to "
                f"limits.max_tensor_bytes = {limits.max_tensor_bytes}"
            )
        image = EncodedImage(fmt, data)
    request = Request(v=1, id=rid, inputs={input_name: image})
    return LabelledRequest(rid, str(path), encode_request(request))


def from_text(text: str, input_name: str = "text") -> LabelledRequest:
    """A request for one text (a text input: the worker tokenizes it)."""
    rid = f"text-{uuid.uuid4().hex[:8]}"
    label = text if len(text) <= 40 else text[:37] + "..."
    return LabelledRequest(
        rid, repr(label), encode_request(Request(v=1, id=rid, inputs={input_name: text}))
    )


def from_samples(n: int, model: str = "digits") -> list[LabelledRequest]:
    """``n`` labelled held-out samples of a bundled model: digits (8x8, grey) or
    sentiment (review texts; 1 = positive)."""
    out = []
    run = uuid.uuid4().hex[:8]
    if model == "sentiment":
        from worker.ops.samples import sentiment_samples

        for i, text in enumerate(sentiment_samples(1)[:n]):
            rid = f"sample-{i}-{run}"
            request = Request(v=1, id=rid, inputs={"text": text.text}, meta={"label": text.label})
            label = f"sample {i} ({'positive' if text.label else 'negative'})"
            out.append(LabelledRequest(rid, label, encode_request(request)))
        return out
    from worker.ops.samples import labelled_samples

    for i, sample in enumerate(labelled_samples(1)[:n]):
        rid = f"sample-{i}-{run}"
        request = Request(v=1, id=rid, inputs={"image": Tensor.from_numpy(sample.image)},
                          meta={"label": sample.label})  # fmt: skip
        out.append(LabelledRequest(rid, f"sample {i} (a {sample.label})", encode_request(request)))
    return out


async def send(
    kafka: KafkaConfig,
    topic: str,
    requests: Sequence[LabelledRequest],
    max_bytes: int,
    oip: bool = False,
) -> None:
    """Send ``requests``; with ``oip``, as Open Inference Protocol JSON (header
    ``content-type: application/json``) instead of msgpack."""
    producer = AIOKafkaProducer(**connection(kafka), acks="all", max_request_size=max_bytes)
    await started(producer)
    try:
        for r in requests:
            value = encode_oip_request(decode_request(r.value)) if oip else r.value
            headers = [("content-type", JSON.encode())] if oip else []
            await producer.send_and_wait(topic, value, key=r.id.encode(), headers=headers)
            print(f"sent {r.id}  ({r.label})", file=sys.stderr)
    finally:
        await producer.stop()


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
            f"{k} {t.dtype}{list(t.shape)}" for k, t in result.outputs.items()
        ))  # fmt: skip
    total = result.timing_us.get("total")
    if total is not None:
        parts.append(f"in {total / 1000:.1f} ms")
    return f"{result.id}  ok  " + "  ".join(parts)


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
) -> int:
    """Print results (of ``ids`` only, when given) as they arrive. Returns how
    many of ``ids`` were not answered before ``timeout`` (0 when none given)."""
    topics = [kafka.output_topic] + ([kafka.dlq_topic] if include_dlq else [])
    collector = Collector(connection(kafka), topics)
    await collector.start()
    wanted = set(ids or ())
    seen: set[str] = set()

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
            is_json = rec.headers.get("content-type", b"").startswith(JSON.encode())
            result = decode_oip_result(rec.value) if is_json else decode_result(rec.value)
        except Exception as exc:  # boundary: a foreign or corrupt record on the topic
            print(f"(unreadable record at {topic}/{rec.partition}@{rec.offset}: {exc})")
            return
        seen.add(result.id)
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
    return len(missing)


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
    texts: Sequence[str] = (),
    input_name: str | None = None,
    sample_model: str = "digits",
    oip: bool = False,
    meta: Mapping[str, Any] | None = None,
) -> int:
    requests = [from_file(Path(f), limits, input_name or "image") for f in files]
    requests += [from_text(t, input_name or "text") for t in texts]
    requests += from_samples(samples, sample_model)
    requests = with_meta(requests, meta or {})
    if not requests:
        raise ConfigError("nothing to send: give image files, --text TEXT, or --samples N")

    async def go() -> int:
        await send(kafka, kafka.input_topics[0], requests, request_size(limits), oip)
        if not wait:
            return 0
        ids = {r.id for r in requests}
        missing = await watch(
            kafka, ids=ids, timeout=timeout, json_lines=json_lines, include_dlq=False
        )
        return 1 if missing else 0

    return run_tool(kafka, go())


def run_consume(
    kafka: KafkaConfig, ids: Sequence[str], timeout: float | None, json_lines: bool
) -> int:
    missing = run_tool(
        kafka, watch(kafka, ids=set(ids) or None, timeout=timeout, json_lines=json_lines)
    )
    return 1 if missing else 0


__all__: list[str] = [
    "describe",
    "from_file",
    "from_samples",
    "run_consume",
    "run_produce",
    "watch",
]
