"""A repository model's version set through the control topic while it serves
(issue 68): how long from the record to the first answer of the new version,
and what the requests around the swap see.

    .venv/bin/python -m benchmarks.model_swap [--broker embedded] [--rate 200] \\
        [--swaps 4] [--width 2048] [--json out.json]

One worker serves ``scorer`` from a repository of two versions (a 4-layer MLP of
``--width``, 4 x width^2 float32 weights each: 64 MiB at 2048) with
``kafka.control_topic``. Requests are sent open loop at ``--rate`` throughout;
every few seconds the other version is written to the control topic, as
``infer-worker models load`` writes it. Per swap: ``swap_s``, the record's
broker timestamp to the first answer carrying the new version (loaded beside
the serving one, bound, checked, run once, swapped in); and the end-to-end
p50/p99 (answer's broker timestamp minus the request's) of the requests sent
in the second before each swap against those sent while one was under way.
Every request is answered once (checked). Benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.summary import emit
from devkit.apache_kafka import KafkaCluster
from worker.config import KafkaConfig
from worker.contract import Request, Tensor, encode_request
from worker.kafka import control
from worker.model.files import content_version
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

PARTS = 4
STAMPED = {"message.timestamp.type": "LogAppendTime"}


def _mlp(path: Path, seed: int, width: int) -> Path:
    """x float32 [batch, width] -> y float32 [batch, width]: four relu layers."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, last = [], [], "x"
    for k in range(4):
        w = rng.normal(0, 1 / np.sqrt(width), (width, width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        nodes += [helper.make_node("MatMul", [last, f"w{k}"], [f"h{k}"]),
                  helper.make_node("Relu", [f"h{k}"], [f"y{k}" if k < 3 else "y"])]  # fmt: skip
        last = f"y{k}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _percentiles(ms: Sequence[float]) -> dict[str, float]:
    if not ms:
        return {"n": 0}
    a = np.asarray(ms)
    return {"n": int(a.size), "p50_ms": round(float(np.percentile(a, 50)), 1),
            "p99_ms": round(float(np.percentile(a, 99)), 1)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with (EmbeddedBroker() if args.broker == "embedded" else KafkaCluster(1) as broker,
          tempfile.TemporaryDirectory() as tmp):  # fmt: skip
        bs = broker.bootstrap
        t = {k: f"swap.{k}" for k in ("requests", "results", "dlq", "control")}
        await create_topics(bs, {t["requests"]: PARTS, t["results"]: PARTS, t["dlq"]: 1,
                                 t["control"]: 1},
                            {t["requests"]: STAMPED, t["results"]: STAMPED,
                             t["control"]: STAMPED})  # fmt: skip
        repo = Path(tmp) / "models"
        files = {}
        for v in (1, 2):
            (repo / "scorer" / str(v)).mkdir(parents=True)
            files[v] = _mlp(repo / "scorer" / str(v) / "model.onnx", v, args.width)
        (repo / "scorer" / "model.toml").write_text(f'topics = ["{t["requests"]}"]\n')
        version_of = {content_version(f): v for v, f in files.items()}
        w = spawn_worker(bs, input_topics=[t["requests"]], output_topic=t["results"],
                         dlq_topic=t["dlq"], group_id="swap",
                         extra_env={"INFER_WORKER_REPOSITORY__PATH": str(repo),
                                    "INFER_WORKER_KAFKA__CONTROL_TOPIC": t["control"],
                                    "INFER_WORKER_LOGGING__LEVEL": "warning"})  # fmt: skip
        k = KafkaConfig(bootstrap_servers=bs, input_topics=(t["requests"],),
                        control_topic=t["control"])  # fmt: skip
        c = Collector(bs, [t["results"]])
        await c.start()
        rng = np.random.default_rng(68)
        x = rng.normal(size=args.width).astype(np.float32)
        n = int(args.rate * args.every * (args.swaps + 1))
        requests = [(f"r{i}".encode(), encode_request(Request(
            v=1, id=f"r{i}", inputs={"x": Tensor.from_numpy(x)}))) for i in range(n)]  # fmt: skip
        try:
            await asyncio.to_thread(w.wait_until, lambda m: m.get("infer_assigned_partitions", 0)
                                    >= PARTS, 120.0, "assignment")  # fmt: skip
            sending = asyncio.create_task(produce_all(bs, t["requests"], requests, rate=args.rate,
                                                      partition_of=lambda i: i % PARTS))
            swaps: list[float] = []  # each record's wall time, then its broker time
            serving = 2
            for _ in range(args.swaps):
                await asyncio.sleep(args.every)
                serving = 3 - serving
                swaps.append(time.time())
                await control.write(k, "scorer", {"version": serving})
            sent = await sending
            assert await c.collect(lambda c: c.count() >= n, 300.0), f"{c.count()} of {n}"
        finally:
            w.terminate()
            await c.stop()
    stamp = {p.key: p.timestamp_ms for p in sent}
    answers = sorted(((r.timestamp_ms, r.record_key, r.result()) for r in c.records[t["results"]]),
                     key=lambda a: a[0])  # fmt: skip
    ids = [a[2].id for a in answers]
    assert len(set(ids)) == n == len(ids), "a request lost or answered twice"
    assert all(a[2].status == "ok" for a in answers)
    out: list[dict[str, Any]] = []
    for i, at in enumerate(swaps):
        at_ms = at * 1000.0
        want = 1 if i % 2 == 0 else 2
        first = next((a[0] for a in answers if a[0] >= at_ms
                      and version_of[a[2].model.version] == want), None)  # fmt: skip
        if first is None:
            out.append({"swap": i, "to_version": want, "swap_s": None})
            continue
        before = [a[0] - stamp[a[1]] for a in answers if at_ms - 1000 <= stamp[a[1]] < at_ms]
        during = [a[0] - stamp[a[1]] for a in answers if at_ms <= stamp[a[1]] <= first]
        out.append({"swap": i, "to_version": want, "swap_s": round((first - at_ms) / 1e3, 3),
                    "before": _percentiles(before), "during": _percentiles(during)})  # fmt: skip
        print(f"  {out[-1]}", file=sys.stderr, flush=True)
    return {"broker": args.broker, "rate": args.rate, "width": args.width,
            "model_mib": round(4 * args.width * args.width * 4 / 2**20, 1), "requests": n,
            "answered_once": True, "swaps": out}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=("embedded", "kafka"), default="embedded")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--swaps", type=int, default=4)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between swaps")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.model_swap"):
        summary = asyncio.run(run(args))
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
