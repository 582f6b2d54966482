"""Throwaway probe: the writer's per-record cost on a 250-answer ok batch.

    .venv/bin/python benchmarks/results/2026-11-27-s9/micro_records.py

Times ``Answers.records`` (answers to records) and ``Answers.acknowledged`` (the
offsets settled) for digits answers, and the pieces of ``record_for``.
Benchmark code, not shipped.
"""

from __future__ import annotations

import asyncio
import time
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from worker.config import KafkaConfig
from worker.contract import ModelInfo, Request, Tensor
from worker.contract.ok_results import encode_ok_at
from worker.flow.messages import Answer, Completed, Job, TopicPartition
from worker.flow.offsets import OffsetTracker
from worker.kafka.commit import Committer
from worker.kafka.delivery.answers import Answers
from worker.kafka.delivery.outgoing import Topics, _encoded, record_for
from worker.kafka.delivery.writer import WriterParts

TP = TopicPartition("drain.requests", 3)
MODEL = ModelInfo("digits", "0123456789abcdef")
TIMING = {"queue": 1200, "preprocess": 30, "infer": 400}


class _Group:
    async def commit(self, offsets: Any) -> None:
        pass


def per_call_us(name: str, fn: Callable[[], object], n: int, per: int = 1) -> None:
    best = min(timeit.repeat(fn, number=n, repeat=5))
    print(f"{name}: {best / n / per * 1e6:.2f} us")


def batch(tracker: OffsetTracker) -> Completed:
    img = np.zeros((16, 16, 1), np.uint8)
    req = Request(v=1, id="req-12345", inputs={"image": Tensor.from_numpy(img)}, meta={"i": 7})
    answers = []
    for offset in range(250):
        epoch = tracker.track(TP, offset, 300)
        job = Job(TP, offset, b"12345", arrived=time.monotonic(), deadline=None, request=req,
                  inputs={"image": img}, lengths={}, epoch=epoch, timestamp_ms=1,
                  wire="msgpack")  # fmt: skip
        outputs = {"probabilities": np.random.rand(10).astype(np.float32),
                   "topk_indices": np.arange(3)}  # fmt: skip
        answers.append(Answer(job, outputs, None, dict(TIMING)))
    return Completed(seq=1, answers=tuple(answers), engine_rows=250)


def main() -> None:
    tracker = OffsetTracker()
    parts = WriterParts(asyncio.Queue(), KafkaConfig(), MODEL, tracker,
                        Committer(tracker, _Group()))  # fmt: skip
    answers = Answers(parts)
    completed = batch(tracker)
    per_call_us("records, per record", lambda: answers.records(completed), 200, 250)
    records = answers.records(completed)

    def tracked() -> OffsetTracker:
        fresh = OffsetTracker()
        for offset in range(250):
            fresh.track(TP, offset, 300)
        return fresh

    def acknowledged() -> None:
        answers._tracker = tracked()
        answers.acknowledged(records)

    ack = min(timeit.repeat(acknowledged, number=200, repeat=5))
    track = min(timeit.repeat(tracked, number=200, repeat=5))
    print(f"acknowledged, per record: {(ack - track) / 200 / 250 * 1e6:.2f} us")
    answer, topics = completed.answers[0], Topics("out", "dlq")
    job = answer.job
    assert answer.outputs is not None
    outputs = answer.outputs
    per_call_us("encode_ok_at", lambda: encode_ok_at(
        "req-12345", outputs, MODEL, job.tp.topic, job.tp.partition, job.offset,
        {**TIMING, "total": 5}, {"i": 7}), 100_000)  # fmt: skip
    per_call_us("_encoded", lambda: _encoded(answer, MODEL, topics, 1, 5.0), 100_000)
    per_call_us("record_for", lambda: record_for(answer, MODEL, topics, 1, 5.0, 10**6), 100_000)


if __name__ == "__main__":
    main()
