"""Per-record costs of the worker's own Python on the hot path, in microseconds.

    .venv/bin/python -m benchmarks.record_budget [--json out.json]
    # the code of another commit, same interpreter and packages:
    (cd ../base && PYTHONPATH=$PWD ../main/.venv/bin/python -m benchmarks.record_budget)

Times, with ``timeit``, what every record costs on the event loop: decoding a
16x16 digits request (as the drain and the demo send it, with a small meta),
making its ``Job`` (the intake's fields), encoding its ``ok`` result (two
outputs, as the digits model's postprocessing gives them), and the three latency
histograms it is observed in. Only APIs both this commit and the one before
issue 36 have are used, so the same file measures either. Benchmark code, not
shipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from worker.contract import (
    ModelInfo,
    Request,
    Source,
    Tensor,
    decode_request,
    encode_ok_result,
    encode_request,
)
from worker.flow.messages import Job, TopicPartition
from worker.obs import metrics


def per_call_us(fn: Callable[[], object], number: int) -> float:
    best = min(timeit.repeat(fn, number=number, repeat=5))
    return round(best / number * 1e6, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=50_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    n = args.number
    image = np.random.default_rng(0).integers(0, 16, (16, 16, 1), dtype=np.uint8)
    value = Request(v=1, id="req-12345", inputs={"image": Tensor.from_numpy(image)}, meta={"i": 7})
    wire = encode_request(value)
    request = decode_request(wire)
    tp = TopicPartition("drain.requests", 3)

    def job() -> Job:
        return Job(tp, 12345, b"12345", arrived=1.0, deadline=None, request=request,
                   inputs={"image": image}, lengths={}, epoch=1, timestamp_ms=1,
                   wire="msgpack")  # fmt: skip

    outputs = {"probabilities": np.random.rand(10).astype(np.float32),
               "topk_indices": np.arange(3)}  # fmt: skip
    model, source = ModelInfo("digits", "0123456789abcdef"), Source("drain.requests", 3, 12345)
    timing = {"queue": 1200, "preprocess": 30, "infer": 400, "total": 2100}
    registry = CollectorRegistry()
    hist = Histogram("budget_seconds", "b", registry=registry)
    observe_all = getattr(metrics, "observe_all", None)
    batch = [0.001 * i for i in range(64)]

    def histograms() -> None:  # three histograms per record, as the worker observes them
        if observe_all is not None:
            for _ in range(3):
                observe_all(hist, batch)
        else:
            for _ in range(3):
                for amount in batch:
                    hist.observe(amount)

    budget = {
        "decode_request": per_call_us(lambda: decode_request(wire), n),
        "job": per_call_us(job, n),
        "encode_ok_result": per_call_us(
            lambda: encode_ok_result("req-12345", outputs, model, source, timing, {"i": 7}), n
        ),
        "three_histograms": round(per_call_us(histograms, n // 64) / 64, 3),
    }
    budget["total"] = round(sum(budget.values()), 3)
    out = {"python": sys.version.split()[0], "per_record_us": budget}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
