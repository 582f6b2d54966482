"""Models that come while serving (issue 68): how long from the control record
that brings a model to its first answer, against a version swap of the serving
model in the same run, and what the serving model's requests see meanwhile.

    .venv/bin/python -m benchmarks.model_come [--broker embedded] [--rate 100] \\
        [--rounds 3] [--width 1024] [--json out.json]

One worker serves ``a`` (``repository.models = ["a"]``, versions 1 and 2 of a
``benchmarks.model_swap`` MLP of ``--width``) with ``kafka.control_topic``;
requests go to ``a``'s topic open loop at ``--rate`` throughout. Each round:
the other version of ``a`` is written (a swap: loaded beside, bound, checked,
swapped in; no rebalance), then, a few seconds later, the record bringing
``bN`` (the same MLP, on a topic of its own already holding requests): loaded,
bound, probed, its stages joined, its topic read (the subscription grows: a
rebalance). Per round: ``swap_s`` and ``come_s`` (the record's write to the
first answer of the new version / of ``bN``), and the end-to-end p50/p99 of
``a``'s requests sent in the second before the record against those sent
while the model came (answer's broker timestamp minus the request's). Every
request is answered once (checked). Benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.model_swap import STAMPED, _mlp, _percentiles
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
BACKLOG = 20  # requests waiting on each brought model's topic before its record


def _requests(prefix: str, x: np.ndarray, n: int) -> list[tuple[bytes, bytes]]:
    inputs = {"x": Tensor.from_numpy(x)}
    return [(f"{prefix}{i}".encode(), encode_request(Request(v=1, id=f"{prefix}{i}",
                                                              inputs=inputs)))
            for i in range(n)]  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    every = 4.0  # seconds between records
    with (EmbeddedBroker() if args.broker == "embedded" else KafkaCluster(1) as broker,
          tempfile.TemporaryDirectory() as tmp):  # fmt: skip
        bs = broker.bootstrap
        brought = [f"b{i}" for i in range(args.rounds)]
        t = {m: f"come.{m}" for m in ("a", *brought)}
        out_t, ctl = "come.results", "come.control"
        await create_topics(bs, {**dict.fromkeys(t.values(), PARTS), out_t: PARTS,
                                 "come.dlq": 1, ctl: 1},
                            {**dict.fromkeys([*t.values(), out_t, ctl], STAMPED)})  # fmt: skip
        repo = Path(tmp) / "models"
        files = {}
        for name, versions in (("a", (1, 2)), *((b, (1,)) for b in brought)):
            for v in versions:
                (repo / name / str(v)).mkdir(parents=True)
                files[name, v] = _mlp(repo / name / str(v) / "model.onnx", v, args.width)
            (repo / name / "model.toml").write_text(f'topics = ["{t[name]}"]\n')
        version_of = {content_version(files["a", v]): v for v in (1, 2)}
        w = spawn_worker(bs, input_topics=[t["a"]], output_topic=out_t, dlq_topic="come.dlq",
                         group_id="come",
                         extra_env={"INFER_WORKER_REPOSITORY__PATH": str(repo),
                                    "INFER_WORKER_REPOSITORY__MODELS": "a",
                                    "INFER_WORKER_KAFKA__CONTROL_TOPIC": ctl,
                                    "INFER_WORKER_LOGGING__LEVEL": "warning"})  # fmt: skip
        k = KafkaConfig(bootstrap_servers=bs, input_topics=(t["a"],), control_topic=ctl)
        c = Collector(bs, [out_t])
        await c.start()
        x = np.random.default_rng(68).normal(size=args.width).astype(np.float32)
        n = int(args.rate * every * (2 * args.rounds + 1))
        sent = []
        for b in brought:  # waiting on the topics no member reads yet
            sent += await produce_all(bs, t[b], _requests(f"{b}-", x, BACKLOG))
        try:
            await asyncio.to_thread(w.wait_until, lambda m: m.get("infer_assigned_partitions", 0)
                                    >= PARTS, 120.0, "assignment")  # fmt: skip
            stream = produce_all(bs, t["a"], _requests("a-", x, n), rate=args.rate,
                                 partition_of=lambda i: i % PARTS)  # fmt: skip
            sending = asyncio.create_task(stream)
            records: list[tuple[str, float, int]] = []  # (what, wall time, a's version)
            serving = 2
            for b in brought:
                await asyncio.sleep(every)
                serving = 3 - serving
                records.append(("swap", time.time(), serving))
                await control.write(k, "a", {"version": serving})
                await asyncio.sleep(every)
                records.append((b, time.time(), serving))
                await control.write(k, b, {"version": 1})
            sent += await sending
            total = n + BACKLOG * args.rounds
            assert await c.collect(lambda c: c.count() >= total, 300.0), f"{c.count()} of {total}"
        finally:
            w.terminate()
            await c.stop()
    stamp = {p.key: p.timestamp_ms for p in sent}
    answers = sorted(((r.timestamp_ms, r.record_key, r.result()) for r in c.records[out_t]),
                     key=lambda a: a[0])  # fmt: skip
    ids = [a[2].id for a in answers]
    assert len(set(ids)) == total == len(ids), (
        f"a request lost or answered twice: {len(set(ids))} ids, {len(ids)} answers, {total} "
        f"sent; twice: {sorted(i for i in set(ids) if ids.count(i) > 1)[:20]}")  # fmt: skip
    assert all(a[2].status == "ok" for a in answers)
    rounds: list[dict[str, Any]] = []
    for what, at, version in records:
        at_ms = at * 1000.0
        def new(r: Any, what: str = what, version: int = version) -> bool:
            if what != "swap":
                return bool(r.model.name == what)
            return bool(r.model.name == "a" and version_of[r.model.version] == version)

        first = next((a[0] for a in answers if a[0] >= at_ms and new(a[2])), None)
        a_answers = [a for a in answers if a[2].model.name == "a"]
        before = [a[0] - stamp[a[1]] for a in a_answers if at_ms - 1000 <= stamp[a[1]] < at_ms]
        during = [a[0] - stamp[a[1]] for a in a_answers
                  if first is not None and at_ms <= stamp[a[1]] <= first]  # fmt: skip
        row = {"record": "swap" if what == "swap" else "come", "model": what,
               "seconds": None if first is None else round((first - at_ms) / 1e3, 3),
               "a_before": _percentiles(before), "a_during": _percentiles(during)}  # fmt: skip
        rounds.append(row)
        print(f"  {row}", file=sys.stderr, flush=True)
    swaps = [r["seconds"] for r in rounds if r["record"] == "swap"]
    comes = [r["seconds"] for r in rounds if r["record"] == "come"]
    return {"broker": args.broker, "rate": args.rate, "width": args.width,
            "model_mib": round(4 * args.width * args.width * 4 / 2**20, 1), "requests": total,
            "answered_once": True, "records": rounds,
            "come_over_swap": [round(c / s, 2) for c, s in zip(comes, swaps, strict=True)
                               if c is not None and s]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=("embedded", "kafka"), default="embedded")
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.model_come"):
        summary = asyncio.run(run(args))
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
