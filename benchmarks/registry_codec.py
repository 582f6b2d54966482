"""A record's cost in process, Avro against msgpack (issue 67): the intake
(``JobFactory``: decode, route, check) and the answer (``record_for``) of the
two-input ranker's request (float32 [4], int64 [64]), each timed over
``--n`` calls, no broker. The schema is in the intake's cache as the consumer
leaves it (no registry call is timed).

    .venv/bin/python -m benchmarks.registry_codec [--n 20000] [--repeat 3]

Benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
import timeit
from pathlib import Path

import fastavro
import numpy as np

from worker.compute.engines import load_engine
from worker.config import LimitsConfig, ModelConfig, SchemaRegistryConfig
from worker.contract import Request, Tensor, encode_request
from worker.contract.avro import AvroResults, WriterSchema, result_schema
from worker.flow.messages import Answer
from worker.flow.values import ModelInfo
from worker.kafka.delivery.outgoing import Topics, record_for
from worker.kafka.intake import JobFactory
from worker.kafka.registry import SchemaRegistry, Schemas
from worker.model.inputs import bind

SCHEMA = {"type": "record", "name": "R", "fields": [
    {"name": "id", "type": "string"},
    {"name": "features", "type": {"type": "array", "items": "float"}},
    {"name": "ids", "type": {"type": "array", "items": "long"}}]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.onnx_models import ranker

    cfg = ModelConfig(path=str(ranker(Path(tempfile.mkdtemp()) / "ranker.onnx")))
    inputs = bind(cfg, load_engine(cfg).info.io, LimitsConfig())
    schemas = Schemas(SchemaRegistry(SchemaRegistryConfig(url="http://127.0.0.1:1")), 1.0)
    schemas._known[1] = WriterSchema.of(1, json.dumps(SCHEMA))  # as Schemas.ready leaves it
    avro_intake = JobFactory(inputs, LimitsConfig(), model="r", schemas=schemas)
    msgpack_intake = JobFactory(inputs, LimitsConfig(), model="r")
    rng = np.random.default_rng(0)
    features, ids = rng.normal(size=4).astype(np.float32), rng.integers(1, 50, 64)
    buf = io.BytesIO(b"\x00\x00\x00\x00\x01")
    buf.seek(5)
    fastavro.schemaless_writer(buf, fastavro.parse_schema(SCHEMA),
                               {"id": "r1", "features": features.tolist(), "ids": ids.tolist()})
    avro_value = buf.getvalue()
    msgpack_value = encode_request(Request(v=1, id="r1", inputs={
        "features": Tensor.from_numpy(features), "ids": Tensor.from_numpy(ids)}))  # fmt: skip
    outputs = {"score": np.array([0.5], np.float32),
               "token_scores": rng.normal(size=64).astype(np.float32)}  # fmt: skip
    results = AvroResults(result_schema("InferenceResult", "infer_worker",
                                        {"score": ("float32", (1,)),
                                         "token_scores": ("float32", ("s",))}), 5)  # fmt: skip
    avro_answer = Answer(avro_intake("t", 0, 1, b"k", avro_value, 0), outputs, None, {"queue": 1})
    msgpack_answer = Answer(msgpack_intake("t", 0, 1, b"k", msgpack_value, 0), outputs, None,
                            {"queue": 1})  # fmt: skip
    model = ModelInfo("r", "v")
    cases = {
        "intake_avro": lambda: avro_intake("t", 0, 1, b"k", avro_value, 0),
        "intake_msgpack": lambda: msgpack_intake("t", 0, 1, b"k", msgpack_value, 0),
        "answer_avro": lambda: record_for(avro_answer, model, Topics("o", "d", {"avro": results}),
                                          1, time.monotonic(), 1 << 20),
        "answer_msgpack": lambda: record_for(msgpack_answer, model, Topics("o", "d"), 1,
                                             time.monotonic(), 1 << 20),
    }  # fmt: skip
    us = {name: [round(timeit.timeit(run, number=args.n) / args.n * 1e6, 2)
                 for _ in range(args.repeat)] for name, run in cases.items()}  # fmt: skip
    print(json.dumps({"n": args.n, "us_per_record": us}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
