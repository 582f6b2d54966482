"""Several models on one GPU (issue 66, item 3): a model's end-to-end p99 at a
paced rate while the other model's topic holds a backlog, against its p99 alone,
in one worker serving both, each its own GPU stage and slot ring.

    python -m benchmarks.gpu_models --backend torch [--duration 4] [--share 0.25]
    python -m benchmarks.gpu_models --backend gpu-twin --big-records 600 \\
        --small-records 600 --duration 2     # the plumbing, on any machine

The models (``[models.big]``, ``[models.small]``, a topic each): with ``torch``,
ResNet-50 as ``bench --model resnet50`` runs it (exported program, fp16,
compiled, CUDA graphs, GPU preprocessing, nvJPEG) sent its JPEG photographs,
and the bundled digits MLP as TorchScript (GPU preprocessing) sent raw digit
tensors; with ``gpu-twin``, the digits model twice on the GPU stage's CPU twin,
the big one sent digit JPEGs (the wiring, not the speed: twin figures are not
GPU figures).
One embedded broker, one worker process each scenario, on fresh topics:

1. ``alone`` (one worker): the big model drains a backlog produced before the
   worker started (``drain.big``: img/s at steady state, GPU busy, the bench's
   scoring); the small model drains one produced while the worker serves
   (``drain.small``, at most the producer's rate); then each model alone at
   ``--share`` x its drain rate (or ``--rate-big``/``--rate-small``) for
   ``--duration`` s: end-to-end p50/p99 and the worker's own (``timing_us.total``).
   GPU memory per model and the process's budget come from this worker's log
   (``gpu_model_memory``, ``gpu_memory_share``, ``gpu_memory``) and metrics.
2. ``beside`` (a worker per direction): the other model's topic holds a backlog
   produced before the worker started (its drain rate x (1.5 x duration +
   ``--slack``) records); from the backlog's first answer the paced model is
   sent the same arrivals at the same rate, with no warm-up of its own (its
   warm-up requests would wait behind the backlog: what this measures): its
   p99 beside the backlog, the ratio to alone (target <= 3), and whether the
   backlog outlasted the paced window (if not, the ratio flatters: the JSON
   says so, ``backlog_outlasted``).

The results JSON (``--results-dir``, ``<date>-<device>-models.json``) carries
``device``, ``worker_img_s`` and ``gpu_busy`` (the big model's drain), the
memory, and ``paced`` per model: ``alone``, ``beside``, ``p99_ratio``.
Exit 1 when a request is not answered ok or a worker fails. Benchmark code.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import gpu_phases as phases
from benchmarks.gpu_setups import (
    BACKENDS,
    device_of,
    digits_model,
    memory_report,
    note,
    nvml_for,
    toml_list,
    write_results,
)
from worker.bench.options import IMAGENET_MEAN, IMAGENET_STD, BenchError
from worker.bench.payloads import Value, payload_inputs, request_records
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import WorkerProcess, override_env, spawn_worker
from worker.ops.topics import Collector, produce_all

PARTS = 4
ROLES = ("big", "small")
TARGET_RATIO = 3.0


def big_model(backend: str, work: Path, max_batch: int) -> dict[str, str]:
    """``models.big``: ResNet-50 as the bench's resnet50 runs it (torch), or on the
    twin the digits model in its place."""
    if backend != "torch":
        return digits_model(backend, work, "models.big")
    from worker.ops.build_torch import build_torch_program

    # engines/, as the bench exports it: a bench.jpeg before this in the call left it there.
    program = build_torch_program("torchvision:resnet50", Path("engines"),
                                  max_batch_size=max_batch, input_shape=(3, 224, 224))  # fmt: skip
    return {
        "models.big.path": str(program), "models.big.backend": "torch",
        "models.big.preprocess.size": "[224, 224]", "models.big.preprocess.channels": "3",
        "models.big.preprocess.mean": _listed(IMAGENET_MEAN),
        "models.big.preprocess.std": _listed(IMAGENET_STD),
        "models.big.preprocess.dtype": "float32", "models.big.preprocess.device": "gpu",
        "models.big.torch.precision": "float16",
    }  # fmt: skip


def _listed(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(repr(float(x)) for x in values) + "]"


def settings(args: argparse.Namespace, work: Path) -> dict[str, str]:
    """The worker's settings (dotted keys, TOML literals) but for the topics."""
    out = {"batching.max_batch_size": str(args.max_batch),
           "batching.preferred_batch_sizes": f"[16, {args.max_batch}]"}  # fmt: skip
    if args.backend == "torch":
        out["gpu.decode"] = "nvjpeg"  # the big model's JPEGs, as bench.jpeg decodes them
    out |= big_model(args.backend, work, args.max_batch)
    out |= digits_model(args.backend, work, "models.small")
    return out | dict(kv.split("=", 1) for kv in args.set)


def payloads(backend: str) -> dict[str, list[Value]]:
    big = payload_inputs("resnet50" if backend == "torch" else "digits", "jpeg")[1]
    # The small model's as raw tensors: gpu.decode = "nvjpeg" is the worker's, and
    # greyscale JPEGs through nvJPEG to a one-channel model are not what this measures.
    return {"big": big, "small": payload_inputs("digits", "raw")[1]}


Started = tuple[WorkerProcess, Collector, dict[str, str]]


async def start(bootstrap: str, tag: str, base: dict[str, str], level: str,
                backlogs: dict[str, phases.Records]) -> Started:  # fmt: skip
    """Fresh topics, the backlogs produced to them, then a worker serving both models."""
    t = {k: f"models.{tag}.{k}" for k in (*ROLES, "results", "dlq")}
    await create_topics(bootstrap, {t["big"]: PARTS, t["small"]: PARTS, t["results"]: PARTS,
                                    t["dlq"]: 1})  # fmt: skip
    for role, records in backlogs.items():
        await produce_all(bootstrap, t[role], records, partition_of=lambda i: i % PARTS)
    env = override_env({**base, "models.big.topics": toml_list([t["big"]]),
                        "models.small.topics": toml_list([t["small"]])})  # fmt: skip
    worker = spawn_worker(bootstrap, input_topics=[t["big"], t["small"]],
                          output_topic=t["results"], dlq_topic=t["dlq"],
                          group_id=f"models-{tag}",
                          extra_env={"INFER_WORKER_LOGGING__LEVEL": level, **env})  # fmt: skip
    collector = Collector(bootstrap, [t["results"], t["dlq"]])
    await collector.start()
    return worker, collector, t


async def alone(bootstrap: str, args: argparse.Namespace, base: dict[str, str],
                values: dict[str, list[Value]]) -> dict[str, Any]:  # fmt: skip
    big = request_records("image", values["big"], "dbig", args.big_records)
    worker, c, t = await start(bootstrap, "alone", base, "info", {"big": big})
    topics = phases.Topics(t["results"], t["dlq"])
    nvml, why = nvml_for(args.backend)
    try:
        note(f"drain: {len(big):,} big-model records (produced before the start) ...")
        drains = {"big": await phases.drain(bootstrap, c, topics, worker, b"dbig", big, nvml)}
        small = request_records("image", values["small"], "dsmall", args.small_records)
        note(f"drain: {len(small):,} small-model records (produced while serving) ...")
        drains["small"] = await phases.drain(
            bootstrap, c, topics, worker, b"dsmall", small, nvml, produce_to=t["small"],
            partitions=PARTS)  # fmt: skip
        memory = memory_report(worker)
        paced = {}
        for role in ROLES:
            rate = getattr(args, f"rate_{role}") or args.share * drains[role]["worker_img_s"]
            note(f"{role} alone, paced at {rate:,.0f}/s for {args.duration:g} s ...")
            records = request_records("image", values[role], f"a{role}", n_paced(rate, args))
            paced[role] = await phases.paced(bootstrap, c, topics, t[role], records,
                                             f"a{role}".encode(), rate, PARTS)  # fmt: skip
            paced[role].pop("window")
    finally:
        if nvml is not None:
            nvml.close()
        await c.stop()
        code = await asyncio.to_thread(worker.terminate, 60.0)
    if code != 0:
        raise BenchError(f"the worker exited with {code}; its log:\n{worker.log_tail()}")
    return {"drain": drains, "alone": paced, "memory": memory, "gpu_busy_note": why}


def n_paced(rate: float, args: argparse.Namespace) -> int:
    return max(1, round(rate * float(args.duration)))


async def beside(bootstrap: str, args: argparse.Namespace, base: dict[str, str],
                 values: dict[str, list[Value]], role: str, rate: float,
                 other_rate: float) -> dict[str, Any]:  # fmt: skip
    """``role`` paced at ``rate`` while the other model's topic holds a backlog
    sized from its drain rate (``other_rate``)."""
    other = "small" if role == "big" else "big"
    n = math.ceil(other_rate * (1.5 * args.duration + args.slack))
    backlog = request_records("image", values[other], f"b{other}", n)
    note(f"{role} beside {other}'s backlog of {n:,} (produced before the start) ...")
    worker, c, t = await start(bootstrap, f"beside-{role}-{uuid.uuid4().hex[:6]}", base,
                               "warning", {other: backlog})  # fmt: skip
    topics = phases.Topics(t["results"], t["dlq"])
    try:
        # No warm-up requests: the paced model's would queue behind the backlog and
        # end when it does (the twin showed it). The stages warmed before the join;
        # the clock starts at the backlog's first answer (the worker serving).
        await phases.wait_answers(c, topics, f"b{other}".encode(), 1, worker, 600.0)
        left = n - len(phases.answers(c, topics, f"b{other}".encode()))
        note(f"{role} paced at {rate:,.0f}/s for {args.duration:g} s, {left:,} of the backlog "
             "left ...")  # fmt: skip
        records = request_records("image", values[role], f"p{role}", n_paced(rate, args))
        out = await phases.paced(bootstrap, c, topics, t[role], records, f"p{role}".encode(),
                                 rate, PARTS)  # fmt: skip
        _, end = out.pop("window")
        got = phases.answers(c, topics, f"b{other}".encode())
        during = sum(1 for r in got if r.received_at <= end)
    finally:
        await c.stop()
        worker.kill()  # the rest of the backlog is not measured
    bad = [r for r in got if r.result().status != "ok"]
    if bad:
        raise BenchError(f"{len(bad)} backlog answers were errors, e.g. {bad[0].result().error}")
    return {**out, "backlog": n, "backlog_left_at_start": left,
            "backlog_outlasted": during < n}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    device = device_of(args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        base = settings(args, work)
        values = payloads(args.backend)
        with EmbeddedBroker() as broker:
            first = await alone(broker.bootstrap, args, base, values)
            paced: dict[str, Any] = {}
            for role in args.paced:
                other = "small" if role == "big" else "big"
                rate = first["alone"][role]["rate"]
                near = await beside(broker.bootstrap, args, base, values, role, rate,
                                    first["drain"][other]["worker_img_s"])  # fmt: skip
                alone_p99 = first["alone"][role]["p99_ms"]
                ratio = round(near["p99_ms"] / alone_p99, 2) if alone_p99 > 0 else None
                paced[role] = {"alone": first["alone"][role], "beside": near, "p99_ratio": ratio,
                               "meets_3x": ratio is not None and ratio <= TARGET_RATIO}  # fmt: skip
                note(f"{role}: p99 alone {alone_p99:.1f} ms, beside the backlog "
                     f"{near['p99_ms']:.1f} ms ({ratio}x; backlog outlasted: "
                     f"{near['backlog_outlasted']})")  # fmt: skip
    return {
        "date": dt.date.today().isoformat(),
        "device": device,
        "backend": args.backend,
        "twin": args.backend != "torch",
        "procs": 1,
        "models": {
            "big": "resnet50 (torchvision, random weights; torch, fp16, nvJPEG)"
            if args.backend == "torch" else f"digits ({args.backend}, in resnet50's place)",
            "small": "digits (TorchScript, torch)" if args.backend == "torch"
            else f"digits ({args.backend})",
        },
        "worker_img_s": first["drain"]["big"]["worker_img_s"],
        "gpu_busy": first["drain"]["big"]["gpu_busy"],
        "gpu_busy_note": first["gpu_busy_note"],
        "drain": first["drain"],
        "gpu_memory": first["memory"],
        "paced": paced,
        "target_p99_ratio": TARGET_RATIO,
        "settings": base,
        "command": " ".join(["python -m benchmarks.gpu_models", *sys.argv[1:]]),
        "wall_seconds": round(time.monotonic() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--big-records", type=int, default=12_000,
                        help="the big model's drain backlog")  # fmt: skip
    parser.add_argument("--small-records", type=int, default=20_000,
                        help="the small model's drain, produced while the worker serves")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of each paced run")
    parser.add_argument("--share", type=float, default=0.25,
                        help="paced rate as this share of the model's drain rate")
    parser.add_argument("--rate-big", type=float, default=0.0, metavar="REQ_S")
    parser.add_argument("--rate-small", type=float, default=0.0, metavar="REQ_S")
    parser.add_argument("--slack", type=float, default=3.0, metavar="S",
                        help="backlog seconds beyond the paced run (start, warm-up)")
    parser.add_argument("--paced", nargs="+", choices=ROLES, default=list(ROLES),
                        help="the models paced beside the other's backlog")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--work-dir", help="model files (default: a temporary folder)")
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.gpu_models"):
        summary = asyncio.run(run(args))
    path = write_results(summary, args.results_dir, "models", args.json)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
