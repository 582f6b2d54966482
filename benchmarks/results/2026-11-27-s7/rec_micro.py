"""Throwaway timing (issue 36): record_for and encode_ok_result per answer, for a
256-row digits batch (two outputs, a meta). Run with a commit's code first on
PYTHONPATH to time that commit."""

import timeit

import numpy as np

from worker.contract import (
    ModelInfo,
    Request,
    Tensor,
    decode_request,
    encode_ok_result,
    encode_request,
)
from worker.flow.messages import Answer, Job, TopicPartition
from worker.kafka.delivery.outgoing import Topics, record_for

image = np.random.default_rng(0).integers(0, 16, (16, 16, 1), dtype=np.uint8)
value = Request(v=1, id="req-12345", inputs={"image": Tensor.from_numpy(image)}, meta={"i": 7})
request = decode_request(encode_request(value))
job = Job(
    TopicPartition("drain.requests", 3), 12345, b"12345", arrived=1.0, deadline=None,
    request=request, inputs={"image": image}, lengths={}, epoch=1, timestamp_ms=1,
)  # fmt: skip
probs = np.random.default_rng(1).random((256, 10), dtype=np.float32)
label = np.arange(256, dtype=np.int64)
timing = {"queue": 12, "preprocess": 3, "infer": 400}
answers = [Answer(job, {"label": label[i], "probabilities": probs[i]}, None, timing)
           for i in range(256)]  # fmt: skip
model = ModelInfo(name="digits", version="1")
topics = Topics(output="out", dlq="dlq")


def records() -> None:
    for a in answers:
        record_for(a, model, topics, 1, 2.0, 1_000_000, None)


def encoded() -> None:
    for a in answers:
        assert a.job.request is not None and a.outputs is not None
        r = a.job.request
        encode_ok_result(r.id, a.outputs, model, a.job.source, a.timing_us, r.meta)


for fn in (records, encoded):
    best = min(timeit.repeat(fn, number=200, repeat=5))
    print(fn.__name__, round(best / 200 / 256 * 1e6, 3), "us per answer")
