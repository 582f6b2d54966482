"""Per-record cost of the intake and of the result records, for a batch of 64
digits requests (16x16, meta {"i": i}), timeit best of 5, the same machine:

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-26-hot-path-micro.py
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-26-hot-path-micro.py intake

(with a piece's name, a cProfile of it). 2026-11-26, 2 cores: intake 15.1
us/record (JobFactory one record at a time: 9.0, of which decode_request 4.6,
ModelInputs.check 2.3, the Job 0.26), record_for 10.6 us/record, Row.of 0.8."""

import cProfile
import pstats
import sys
import time
import timeit

import numpy as np

from tests.models import model_inputs
from worker.config import LimitsConfig
from worker.contract import ModelInfo, Request, Tensor, encode_request
from worker.flow.messages import Answer, Job
from worker.kafka.delivery.outgoing import OutRecord, Topics, record_for
from worker.kafka.intake import JobFactory
from worker.model.rows import Row

make = JobFactory(model_inputs(), LimitsConfig())
image = Tensor.from_numpy(np.random.default_rng(0).integers(0, 16, (16, 16, 1), dtype=np.uint8))
values = [
    encode_request(Request(v=1, id=f"{i}", inputs={"image": image}, meta={"i": i}))
    for i in range(64)
]


def intake() -> list[Job]:
    return [make("drain.requests", 3, 1000 + i, b"k", v, 1, None, 1) for i, v in enumerate(values)]


jobs = intake()
outputs = {"probabilities": np.random.rand(10).astype(np.float32), "topk_indices": np.arange(3)}
timing = {"queue": 10, "preprocess": 3, "infer": 40}
answers = [Answer(job, dict(outputs), None, timing) for job in jobs]
model, topics = ModelInfo("digits", "0123456789abcdef"), Topics("out", "dlq")


def records() -> list[OutRecord]:
    now = time.monotonic()
    return [record_for(a, model, topics, i, now, 1 << 24, None) for i, a in enumerate(answers)]


def rows() -> list[Row]:
    return [Row.of(job) for job in jobs]


PIECES = {"intake": intake, "record_for": records, "Row.of": rows}
if len(sys.argv) > 1:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        PIECES[sys.argv[1]]()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
else:
    for name, piece in PIECES.items():
        best = min(timeit.repeat(piece, number=300, repeat=5)) / 300 / 64 * 1e6
        print(f"{name:12s} {best:6.2f} us/record")
