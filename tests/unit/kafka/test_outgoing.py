"""What the produce stage sends, built without I/O: the hot-path encoding of ok
results must be byte for byte the reference encoding of the same result."""

from __future__ import annotations

import numpy as np
import pytest

from worker.contract import ModelInfo, Request, Tensor, decode_result, encode_result
from worker.flow.errors import UndecodableRecord
from worker.flow.messages import Answer, Job, TopicPartition, TraceContext
from worker.kafka.delivery.outgoing import Topics, build_result, fallback, record_for

MODEL = ModelInfo("digits", "abc123")
TOPICS = Topics(output="out", dlq="dlq")


def _answer(outputs: dict[str, np.ndarray], meta: dict[str, object] | None) -> Answer:
    image = Tensor.from_numpy(np.zeros((2, 2, 1), np.uint8))
    request = Request(v=1, id="req-7", inputs={"image": image}, meta=meta)
    job = Job(TopicPartition("in", 3), 41, b"k", arrived=10.0, deadline=None, request=request)
    return Answer(job, outputs=outputs, timing_us={"queue": 5, "infer": np.int64(7)})  # type: ignore[dict-item]


@pytest.mark.parametrize("meta", [None, {"user": "a", "n": [1, 2]}])
@pytest.mark.parametrize(
    "outputs",
    [
        {
            "topk_indices": np.array([3, 1, 2], np.int64),
            "topk_scores": np.array([0.5, 0.25, 0.125], np.float32),
        },
        {"probabilities": np.linspace(0, 1, 10, dtype=np.float16)},
        {"logits": np.arange(6, dtype=">f4").reshape(2, 3)},  # big-endian: converted
        {"mask": np.array([True, False])},
        {"strided": np.arange(20, dtype=np.int32)[::2]},  # not contiguous
    ],
)
def test_ok_fast_path_equals_the_reference_encoding(
    outputs: dict[str, np.ndarray], meta: dict[str, object] | None
) -> None:
    answer = _answer(outputs, meta)
    out = record_for(answer, MODEL, TOPICS, seq=1, now=11.0, max_bytes=1 << 20)
    reference = encode_result(build_result(answer, MODEL, now=11.0))
    assert out.value == reference
    assert out.kind == "ok" and out.topic == "out" and out.headers == [("id", b"req-7")]
    decoded = decode_result(reference)
    for name, arr in outputs.items():
        assert np.array_equal(decoded.outputs[name].to_numpy(), arr)


def test_an_unsupported_output_dtype_is_refused_as_before() -> None:
    answer = _answer({"c": np.array([1 + 2j])}, None)
    with pytest.raises(ValueError, match="unsupported"):
        record_for(answer, MODEL, TOPICS, seq=1, now=11.0, max_bytes=1 << 20)


def test_undecodable_records_go_to_the_dlq_with_their_bytes() -> None:
    job = Job(TopicPartition("in", 0), 5, b"key", arrived=0.0, deadline=None,
              failure=UndecodableRecord("not msgpack"), raw_value=b"\xc1garbage")  # fmt: skip
    out = record_for(Answer(job), MODEL, TOPICS, seq=2, now=1.0, max_bytes=1 << 20)
    assert out.topic == "dlq" and out.kind == "dlq" and out.value == b"\xc1garbage"
    assert dict(out.headers)["error.code"] == b"undecodable"


def test_a_result_over_the_size_limit_becomes_a_small_too_large_error() -> None:
    answer = _answer({"big": np.zeros(100_000, np.float32)}, None)
    out = record_for(answer, MODEL, TOPICS, seq=3, now=11.0, max_bytes=64 * 1024)
    assert out.fallback and out.kind == "error"
    res = decode_result(out.value or b"")
    assert res.error is not None and res.error.code == "too_large" and res.id == "req-7"


def test_a_fallback_keeps_the_records_trace_context() -> None:
    """What the broker refused for good is replaced by a small record; the trace
    context the original carried goes with it, result or DLQ record alike."""
    trace = TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01", b"k=v")
    result = record_for(_answer({"x": np.zeros(2, np.float32)}, None), MODEL, TOPICS, seq=1,
                      now=11.0, max_bytes=1 << 20, trace=trace)  # fmt: skip
    job = Job(TopicPartition("in", 0), 5, b"key", arrived=0.0, deadline=None,
              failure=UndecodableRecord("not msgpack"), raw_value=b"\xc1garbage")  # fmt: skip
    dlq = record_for(Answer(job), MODEL, TOPICS, seq=2, now=1.0, max_bytes=1 << 20, trace=trace)
    for out in (result, dlq):
        replaced = fallback(out, "too_large", "refused by the broker", MODEL)
        assert replaced.fallback and replaced.kind == out.kind.replace("ok", "error")
        kept = [h for h in replaced.headers if h[0] in ("traceparent", "tracestate")]
        assert kept == trace.headers()
