"""What a pipeline's model step costs beyond its model (issue 65: the copies
between steps): a three-step pipeline (a function, then two models) built as the
worker builds it (``Worker.prepare``: no Kafka), its stage run on batches of
``--batch`` requests in process, each model step's time against its model's own
engine time on the same rows.

    .venv/bin/python -m benchmarks.pipeline_plumbing [--batch 64] [--batches 200]
        [--rounds 10] [--width 1024] [--json out.json]

Plumbing = step time - the engine's time in the step (as the model's stage
measures its runs, ``infer_engine_seconds``): feeding the step (the earlier
step's rows, as columns or as jobs), keeping its outputs. Also reported: the
step beyond the engine run alone back to back on the same rows
(``beyond_alone``), in rounds alternating with the pipeline's batches; an engine
run among other work is slower than back to back (its threads have gone to
sleep), which that share counts as the step's. Run from two checkouts
(PYTHONPATH=<checkout>) to compare them; benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

from worker.app.worker import Worker
from worker.compute.engines import Engine, load_engine
from worker.compute.pipeline import PipelineStage
from worker.config import ModelConfig, Settings, load_settings
from worker.contract import Request, Tensor, encode_request
from worker.flow.messages import Batch, Job
from worker.kafka.intake import JobFactory
from worker.obs import metrics


def standardise(raw: np.ndarray) -> dict[str, np.ndarray]:
    """The function step: raw features scaled."""
    return {"x": ((raw - 0.5) * 2.0).astype(np.float32)}


def _mlp(path: Path, seed: int, width: int) -> Path:
    """x float32 [batch, width] -> y float32 [batch, width]: relu(x @ w)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).normal(0, 0.05, (width, width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


MODELS = {"a": "first", "b": "second"}  # each model step's model

CONFIG = """
[metrics]
port = 0
[kafka]
bootstrap_servers = "127.0.0.1:1"
input_topics = ["bench.requests"]
[batching]
max_batch_size = {batch}
[models.first]
path = "{first}"
[models.second]
path = "{second}"
[pipelines.chain]
topics = ["bench.requests"]
inputs = {{ raw = "float32 [{width}]" }}
outputs = {{ y = "b.y" }}
[[pipelines.chain.steps]]
name = "f"
function = "benchmarks.pipeline_plumbing:standardise"{vectorized}
inputs = {{ raw = "request.raw" }}
outputs = {{ x = "float32 [{width}]" }}
[[pipelines.chain.steps]]
name = "a"
model = "first"
inputs = {{ x = "f.x" }}
[[pipelines.chain.steps]]
name = "b"
model = "second"
inputs = {{ x = "a.y" }}
"""


def _engine_seconds_in_run(model: str) -> float:
    """The model's engine seconds as its stage measured them, serving (the runs
    alone, around them nothing)."""
    return sum(float(s.value) for m in metrics.INFER_SECONDS.collect() for s in m.samples
               if s.name.endswith("_sum") and s.labels.get("model") == model)  # fmt: skip


def _step_seconds(step: str) -> float:
    sample = next(s for m in metrics.PIPELINE_STEP_SECONDS.collect() for s in m.samples
                  if s.name.endswith("_sum") and s.labels.get("step") == step)  # fmt: skip
    return float(sample.value)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        width = args.width
        first, second = _mlp(Path(tmp, "a.onnx"), 1, width), _mlp(Path(tmp, "b.onnx"), 2, width)
        config = Path(tmp, "worker.toml")
        config.write_text(CONFIG.format(batch=args.batch, first=first, second=second, width=width,
                                        vectorized="\nvectorized = true" if args.vectorized
                                        else ""))  # fmt: skip
        engines = {name: cast(Engine, load_engine(ModelConfig(path=str(path))))
                   for name, path in (("a", first), ("b", second))}  # fmt: skip
        try:
            steps, engine_s, in_run, total = asyncio.run(_steps(load_settings(config, env={}),
                                                                engines, args))  # fmt: skip
        finally:
            for engine in engines.values():
                engine.close()
    out: dict[str, Any] = {"batch": args.batch, "batches": args.batches, "width": width,
                           "vectorized": args.vectorized,
                           "rounds": args.rounds,
                           "batch_ms": round(1000 * total / args.batches, 4)}  # fmt: skip
    for name in ("a", "b"):
        step, alone, served = steps[name], engine_s[name], in_run[name]
        out[f"step_{name}_ms"] = round(1000 * step, 4)
        out[f"engine_{name}_ms"] = round(1000 * alone, 4)  # alone, back to back
        out[f"engine_in_run_{name}_ms"] = round(1000 * served, 4)  # as its stage measured it
        out[f"plumbing_{name}_share"] = round((step - served) / step, 4)
        out[f"beyond_alone_{name}_share"] = round((step - alone) / step, 4)
    out["function_step_ms"] = round(1000 * steps["f"], 4)
    return out


def _engine_seconds(engine: Engine, x: np.ndarray, runs: int) -> float:
    """The engine alone's total seconds over ``runs`` runs of ``x``."""
    started = time.perf_counter()
    for _ in range(runs):
        engine.run({"x": x})
    return time.perf_counter() - started


Seconds = dict[str, float]


async def _steps(settings: Settings, engines: dict[str, Engine], args: argparse.Namespace
                 ) -> tuple[Seconds, Seconds, Seconds, float]:  # fmt: skip
    """Each step's mean seconds a batch, each engine alone's a run of the same
    rows, and the pipeline batches' total: in ``--rounds`` rounds, the pipeline's
    batches and the engines' runs alternating, so both see the same machine."""
    worker = Worker(settings)
    stages = await worker.prepare()
    try:
        stage = cast(PipelineStage, stages.models[-1].infer)
        intake = stages.consumer._make_job  # the intake the consumer would use
        assert isinstance(intake, JobFactory)
        rng = np.random.default_rng(0)
        jobs: list[Job] = [
            intake("bench.requests", 0, i, None, encode_request(Request(
                v=1, id=f"r{i}", inputs={"raw": Tensor.from_numpy(
                    rng.random(args.width, dtype=np.float32))})))
            for i in range(args.batch)
        ]  # fmt: skip
        assert all(j.failure is None for j in jobs), jobs[0].failure
        x = rng.random((args.batch, args.width), dtype=np.float32)
        for _ in range(10):  # warm
            await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
            for engine in engines.values():
                engine.run({"x": x})
        step_s = dict.fromkeys(("f", "a", "b"), 0.0)
        in_run = dict.fromkeys(("a", "b"), 0.0)
        engine_s = dict.fromkeys(engines, 0.0)
        total = 0.0
        per_round = max(1, args.batches // args.rounds)
        for _ in range(args.rounds):
            before = {s: _step_seconds(s) for s in step_s}
            before_run = {s: _engine_seconds_in_run(MODELS[s]) for s in in_run}
            started = time.perf_counter()
            for _ in range(per_round):
                await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
            total += time.perf_counter() - started
            for s in step_s:
                step_s[s] += _step_seconds(s) - before[s]
            for s in in_run:
                in_run[s] += _engine_seconds_in_run(MODELS[s]) - before_run[s]
            for name, engine in engines.items():
                engine_s[name] += _engine_seconds(engine, x, per_round)
        runs = per_round * args.rounds
    finally:
        await worker.stop()
    return ({s: v / runs for s, v in step_s.items()}, {n: v / runs for n, v in engine_s.items()},
            {n: v / runs for n, v in in_run.items()}, total * args.batches / runs)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10,
                        help="the pipeline's batches and the engines' runs alternate this often")
    parser.add_argument("--width", type=int, default=1024, help="each model's [width, width]")
    parser.add_argument("--vectorized", action="store_true",
                        help="the function step called once a batch (vectorized = true)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
