"""A pipeline on the GPU (issue 66, item 4): detect -> crop_boxes -> classify,
drained from Kafka, against the same pipeline on the CPU path.

    python -m benchmarks.gpu_pipeline --backend torch [--requests 20000]
    python -m benchmarks.gpu_pipeline --backend gpu-twin --requests 400   # the plumbing

The pipeline (tests/integration/test_gpu_twin.py's, both model steps on the GPU
backend): ``scale`` (uint8 pixels -> float32, a function), ``detect`` (a 12x12
convolution's map: tests.onnx_models.conv_detector, for torch the same weights
exported as a program at 48x48), ``peak`` (the map's peak as a box, a function),
``crop`` (``crop_boxes`` to 8x8: on the device by the CuPy kernels, since the
pipeline runs a model there: worker.compute.ops.device) and ``digit`` (the
bundled digits MLP; TorchScript for torch). Every request is a 48x48 uint8
image of noise (seeded). Steps between the models pass through the host
(``worker.compute.ops.device``: the GPU stage takes host arrays only; not
built), so ``intermediates_on_device`` is false.

Two workers, one after the other, each on fresh topics with the same backlog
produced before it starts: the CPU path (``onnxruntime``) and ``--backend``.
Each: img/s at steady state (the bench's scoring), the GPU busy fraction (NVML,
for torch), and for the GPU run the memory per ring (``PIPELINE.MODEL``) against
the process's budget. Then every answer of the GPU run against the CPU run's,
by request: the box equal, the digit equal, its score within ``--score-atol``;
``--min-agree`` of the requests must agree (1.0 on the twin; on a GPU a TF32
convolution can flip a near-tie of the detector's peak, and a different box is
a different crop), else exit 1. The results JSON (``--results-dir``,
``<date>-<device>-pipeline.json``): ``device``, ``worker_img_s``,
``gpu_busy``, ``cpu_path``, ``agreement``, the memory. Benchmark code.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import gpu_phases as phases
from benchmarks.gpu_setups import (
    BACKENDS,
    DETECT_SIDE,
    detector_model,
    device_of,
    digits_model,
    memory_report,
    note,
    nvml_for,
    write_results,
)
from tests import read_pipeline
from worker.bench.options import BenchError
from worker.contract import Request, Result, Tensor, encode_request
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

PARTS = 4
PIPELINE = """
[pipelines.read]
topics = ["{topic}"]
inputs = {{ pixels = "uint8 [H, W, 1]" }}
outputs = {{ digit = "digit.topk_indices", score = "digit.topk_scores", boxes = "peak.boxes" }}
{read_steps}"""


def toml_value(value: str) -> str:
    """A dotted setting's value (a TOML literal, or a bare string as ``--set``
    takes it) as TOML."""
    try:
        tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        return json.dumps(value)
    return value


def config(backend: str, work: Path, topic: str, max_batch: int) -> str:
    """The worker's TOML: both models on ``backend``, the pipeline on ``topic``."""
    settings = {"batching.max_batch_size": str(max_batch),
                **detector_model(backend, work, "models.detector", max_batch),
                **digits_model(backend, work, "models.digits")}  # fmt: skip
    if backend == "torch":  # two buckets to warm and capture per slot, as bench.jpeg's
        settings["batching.preferred_batch_sizes"] = f"[16, {max_batch}]"
    lines = [f"{k} = {toml_value(v)}" for k, v in settings.items()]
    return "\n".join(lines) + "\n" + PIPELINE.format(topic=topic, read_steps=read_pipeline.STEPS)


def records(n: int, seed: int) -> phases.Records:
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (DETECT_SIDE, DETECT_SIDE, 1)).astype(np.uint8)
              for _ in range(min(n, 256))]  # fmt: skip
    return [(f"r-{i}".encode(), encode_request(Request(
        v=1, id=f"r-{i}", inputs={"pixels": Tensor.from_numpy(images[i % len(images)])})))
        for i in range(n)]  # fmt: skip


async def drain_run(bootstrap: str, backend: str, work: Path, backlog: phases.Records,
                    max_batch: int) -> tuple[dict[str, Any], dict[str, Result]]:  # fmt: skip
    """One worker serving the pipeline on ``backend`` drains ``backlog``: its figures
    and its answers by request id."""
    tag = f"{backend}-{uuid.uuid4().hex[:6]}"
    t = {k: f"pipe.{tag}.{k}" for k in ("requests", "results", "dlq")}
    await create_topics(bootstrap, {t["requests"]: PARTS, t["results"]: PARTS, t["dlq"]: 1})
    await produce_all(bootstrap, t["requests"], backlog, partition_of=lambda i: i % PARTS)
    path = work / f"{tag}.toml"
    path.write_text(config(backend, work, t["requests"], max_batch))
    worker = spawn_worker(bootstrap, input_topics=[t["requests"]], output_topic=t["results"],
                          dlq_topic=t["dlq"], group_id=f"pipe-{tag}",
                          command=("run", "--config", str(path)),
                          extra_env={"INFER_WORKER_LOGGING__LEVEL": "info"})  # fmt: skip
    c = Collector(bootstrap, [t["results"], t["dlq"]])
    topics = phases.Topics(t["results"], t["dlq"])
    nvml, why = nvml_for(backend) if backend != "onnxruntime" else (None, "the CPU path")
    await c.start()
    try:
        note(f"{backend}: draining {len(backlog):,} requests ...")
        figures = await phases.drain(bootstrap, c, topics, worker, b"r-", backlog, nvml)
        figures["gpu_busy_note"] = why
        if backend != "onnxruntime":
            figures["gpu_memory"] = memory_report(worker)
    finally:
        if nvml is not None:
            nvml.close()
        await c.stop()
        code = await asyncio.to_thread(worker.terminate, 60.0)
    if code != 0:
        raise BenchError(f"the {backend} worker exited with {code}:\n{worker.log_tail()}")
    note(f"{backend}: {figures['worker_img_s']:,.0f} img/s (GPU busy {figures['gpu_busy']})")
    got = {r.result().id: r.result() for r in phases.answers(c, topics, b"r-")}
    return figures, got


def agreement(gpu: Mapping[str, Result], cpu: Mapping[str, Result],
              score_atol: float) -> dict[str, Any]:  # fmt: skip
    """Per request: the same box, the same digit, its score within ``score_atol``."""
    boxes = digits = scores = 0
    worst = 0.0
    differ: list[str] = []
    for rid, want in cpu.items():
        have = gpu[rid]
        same_box = np.array_equal(have.outputs["boxes"].to_numpy(),
                                  want.outputs["boxes"].to_numpy())  # fmt: skip
        same_digit = np.array_equal(have.outputs["digit"].to_numpy(),
                                    want.outputs["digit"].to_numpy())  # fmt: skip
        gap = float(np.abs(have.outputs["score"].to_numpy().astype(np.float64)
                           - want.outputs["score"].to_numpy()).max(initial=0.0))  # fmt: skip
        boxes += same_box
        digits += same_digit
        if same_box and same_digit:
            worst = max(worst, gap)
            scores += gap <= score_atol
        if not (same_box and same_digit and gap <= score_atol) and len(differ) < 10:
            differ.append(rid)
    n = len(cpu)
    return {"requests": n, "same_box": boxes, "same_digit": digits,
            "agree": scores, "agree_fraction": round(scores / n, 5) if n else 0.0,
            "score_atol": score_atol, "score_max_gap_where_same": worst,
            "first_differing": differ}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    backlog = records(args.requests, args.seed)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        work = Path(args.work_dir or tmp)
        cpu, cpu_answers = await drain_run(broker.bootstrap, "onnxruntime", work, backlog,
                                           args.max_batch)  # fmt: skip
        gpu, gpu_answers = await drain_run(broker.bootstrap, args.backend, work, backlog,
                                           args.max_batch)  # fmt: skip
    agree = agreement(gpu_answers, cpu_answers, args.score_atol)
    min_agree = args.min_agree if args.min_agree is not None else (
        1.0 if args.backend != "torch" else 0.99)  # fmt: skip
    agree["min_agree"] = min_agree
    agree["within_tolerance"] = agree["agree_fraction"] >= min_agree
    return {
        "date": dt.date.today().isoformat(),
        "device": device_of(args.backend),
        "backend": args.backend,
        "twin": args.backend != "torch",
        "procs": 1,
        "pipeline": "scale -> detect (12x12 conv) -> peak -> crop_boxes 8x8 -> digits",
        "image": f"uint8 {DETECT_SIDE}x{DETECT_SIDE}x1 noise, seed {args.seed}",
        "requests": args.requests,
        "worker_img_s": gpu["worker_img_s"],
        "gpu_busy": gpu["gpu_busy"],
        "gpu_busy_note": gpu["gpu_busy_note"],
        "worker_to_cpu_path": round(gpu["worker_img_s"] / cpu["worker_img_s"], 3)
        if cpu["worker_img_s"] else None,
        "intermediates_on_device": False,
        "gpu": gpu,
        "cpu_path": cpu,
        "agreement": agree,
        "command": " ".join(["python -m benchmarks.gpu_pipeline", *sys.argv[1:]]),
        "wall_seconds": round(time.monotonic() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=66)
    parser.add_argument("--score-atol", type=float, default=1e-3,
                        help="the digit's score, GPU against CPU, where box and digit agree")
    parser.add_argument("--min-agree", type=float, default=None,
                        help="share of requests that must agree (default 1.0 on the twin, "
                             "0.99 on torch)")  # fmt: skip
    parser.add_argument("--work-dir", help="model files (default: a temporary folder)")
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.gpu_pipeline"):
        summary = asyncio.run(run(args))
    path = write_results(summary, args.results_dir, "pipeline", args.json)
    print(f"results: {path}")
    a = summary["agreement"]
    print(f"{summary['device']}: {summary['worker_img_s']:,.0f} img/s (CPU path "
          f"{summary['cpu_path']['worker_img_s']:,.0f}), GPU busy {summary['gpu_busy']}; "
          f"{a['agree']} of {a['requests']} answers as the CPU path's")  # fmt: skip
    if not a["within_tolerance"]:
        print(f"agreement {a['agree_fraction']} < {a['min_agree']}: {a['first_differing']}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
