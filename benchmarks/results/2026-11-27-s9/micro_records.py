"""Throwaway: per-record cost of Answers.records on a 250-answer ok batch (digits outputs)."""
import time, timeit, asyncio
import numpy as np
from worker.config import KafkaConfig
from worker.contract import ModelInfo, Request, Tensor
from worker.flow.messages import Answer, Completed, Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.commit import Committer
from worker.kafka.delivery.answers import Answers
from worker.kafka.delivery.writer import WriterParts

class G:
    async def commit(self, offsets): pass

def main():
    tracker = OffsetTracker()
    tp = TopicPartition("drain.requests", 3)
    parts = WriterParts(asyncio.Queue(), KafkaConfig(), ModelInfo("digits", "0123456789abcdef"), tracker, Committer(tracker, G()))
    answers = Answers(parts)
    img = np.zeros((16, 16, 1), np.uint8)
    req = Request(v=1, id="req-12345", inputs={"image": Tensor.from_numpy(img)}, meta={"i": 7})
    outs = []
    for off in range(250):
        epoch = tracker.track(tp, off, 300)
        job = Job(tp, off, b"12345", arrived=time.monotonic(), deadline=None, request=req,
                  inputs={"image": img}, lengths={}, epoch=epoch, timestamp_ms=1, wire="msgpack")
        o = {"probabilities": np.random.rand(1, 10).astype(np.float32)[0], "topk_indices": np.arange(3)}
        outs.append(Answer(job, o, None, {"queue": 1200, "preprocess": 30, "infer": 400}))
    c = Completed(seq=1, answers=tuple(outs), engine_rows=250)
    n = 200
    best = min(timeit.repeat(lambda: answers.records(c), number=n, repeat=5))
    print(f"records: {best/n/250*1e6:.2f} us/record")
    recs = answers.records(c)
    # acknowledged: needs re-tracking each time; time a copy
    def ack():
        t2 = OffsetTracker()
        for off in range(250): t2.track(tp, off, 300)
        answers._tracker = t2
        answers.acknowledged(recs)
    def track_only():
        t2 = OffsetTracker()
        for off in range(250): t2.track(tp, off, 300)
    a = min(timeit.repeat(ack, number=n, repeat=5)); b = min(timeit.repeat(track_only, number=n, repeat=5))
    print(f"acknowledged: {(a-b)/n/250*1e6:.2f} us/record")
    return c, tracker
c, tracker = main()
from worker.contract.ok_results import encode_ok_at
from worker.kafka.delivery.outgoing import record_for, Topics, _encoded
a = c.answers[0]; j = a.job; m = ModelInfo("digits", "0123456789abcdef")
top = Topics("out", "dlq")
def t(name, fn, n=100000):
    best = min(timeit.repeat(fn, number=n, repeat=5)); print(f"{name}: {best/n*1e6:.2f} us")
t("encode_ok_at", lambda: encode_ok_at("req-12345", a.outputs, m, j.tp.topic, j.tp.partition, j.offset, {"queue": 1200, "preprocess": 30, "infer": 400, "total": 5}, {"i": 7}))
t("_encoded", lambda: _encoded(a, m, top, 1, 5.0))
t("record_for", lambda: record_for(a, m, top, 1, 5.0, 1000000, None))
t("owns", lambda: tracker.owns(j.tp, j.offset, j.epoch))
