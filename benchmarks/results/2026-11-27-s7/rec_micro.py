import timeit, time
import numpy as np
from worker.contract import ModelInfo, Request, Tensor, decode_request, encode_request
from worker.flow.messages import Job, TopicPartition, Answer
from worker.kafka.delivery.outgoing import record_for, Topics
from worker.contract import encode_ok_result

image = np.random.default_rng(0).integers(0, 16, (16, 16, 1), dtype=np.uint8)
value = Request(v=1, id="req-12345", inputs={"image": Tensor.from_numpy(image)}, meta={"i": 7})
request = decode_request(encode_request(value))
tp = TopicPartition("drain.requests", 3)
job = Job(tp, 12345, b"12345", arrived=1.0, deadline=None, request=request, inputs={"image": image}, lengths={}, epoch=1, timestamp_ms=1, wire="msgpack")
probs = np.random.default_rng(1).random((256, 10), dtype=np.float32)
label = np.arange(256, dtype=np.int64)
answers = [Answer(job, {"label": label[i], "probabilities": probs[i]}, None, {"queue": 12, "preprocess": 3, "infer": 400}) for i in range(256)]
model = ModelInfo(name="digits", version="1")
topics = Topics(output="out", dlq="dlq")
def f():
    for a in answers:
        record_for(a, model, topics, 1, 2.0, 1_000_000, None)
def g():
    for a in answers:
        encode_ok_result(a.job.request.id, a.outputs, model, a.job.source, a.timing_us, a.job.request.meta)
for fn in (f, g):
    best = min(timeit.repeat(fn, number=200, repeat=5))
    print(fn.__name__, round(best / 200 / 256 * 1e6, 3), "us per answer")
