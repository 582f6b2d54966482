"""Models loaded by demand (``repository.on_demand``, issue 68): what a request
pays when its model must be loaded first, and what alternating two models that
do not fit together costs, each against a budget that holds both, in one run.

    .venv/bin/python -m benchmarks.model_demand [--sizes 16 64] [--rounds 2] \\
        [--probes 4] [--pairs 15] [--json out.json]

Per size (MiB of weights; ``benchmarks.model_swap``'s 4-layer MLP, 1024 wide for
16 MiB, 2048 for 64): a repository of two such models, ``a`` and ``b``, each on
its own topic, served by two workers at once with ``repository.on_demand``:
``evicting``, whose ``limits.max_models_memory_mb`` holds one of them (1.5x what
the other worker measured one to hold), and ``holding``, whose budget holds
both (the baseline: nothing is loaded after start-up). The two take turns
round by round. Each request is sent alone, the next when it is answered;
latency is the answer's broker timestamp minus the request's (LogAppendTime).

- ``first_answer``: a pause, one request to the model that is not loaded
  (``cold``: evicted by the previous probe's requests), a pause, the same
  request again (``warm``: now loaded). On ``holding`` both are warm.
- ``cycle``: requests to ``a`` and ``b`` in turn, back to back: on ``evicting``
  each loads its model and evicts the other. ``cycle_ms``: from a pair's request
  to ``a`` to its answer from ``b``.
- ``worker_load``: the worker's own account of each load by demand (its
  ``model_loaded`` log lines, ``infer_model_load_seconds``), against ``cold``
  minus ``warm``: what a load costs a request beyond the load itself.

Every request's loads are counted (``infer_model_loads_total`` scraped after
its answer): each cold and cycle request on ``evicting`` loaded its model, none
on ``holding`` did (checked). Benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiokafka import AIOKafkaProducer

from benchmarks.model_swap import _mlp, _percentiles
from benchmarks.summary import emit
from devkit.apache_kafka import KafkaCluster
from worker.contract import Request, Tensor, encode_request
from worker.kafka.clients import started
from worker.kafka.credentials import connect_kwargs
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector

STAMPED = {"message.timestamp.type": "LogAppendTime"}
MODELS = ("a", "b")
WIDTH = {16: 1024, 64: 2048}  # MiB of weights -> the MLP's width (4 x width^2 float32)
ROOMY_MB = 8192


@dataclass
class Contender:
    """One worker, its two models' topics, and what was measured on it."""

    name: str
    worker: WorkerProcess
    topics: dict[str, str]  # model -> its requests topic
    results: str
    collector: Collector
    budget_mb: int
    sent: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)
    loads: dict[str, list[float]] = field(default_factory=dict)  # loads seen per request

    def loads_so_far(self) -> float:
        m = self.worker.metrics()
        return sum(v for k, v in m.items() if k.startswith("infer_model_loads_total{"))

    async def ask(self, producer: AIOKafkaProducer, model: str,
                  x: np.ndarray) -> tuple[int, int]:  # fmt: skip
        """One request to ``model``, sent alone and awaited: the request's and
        the answer's broker timestamps, ms."""
        self.sent += 1
        rid = f"{self.name}-{self.sent}"
        value = encode_request(Request(v=1, id=rid, inputs={"x": Tensor.from_numpy(x)}))
        meta = await producer.send_and_wait(self.topics[model], value=value, key=rid.encode())
        want = self.sent
        assert await self.collector.collect(lambda c: c.count() >= want, 120.0), (
            f"{self.name}: {self.collector.count()} of {want} answered\n" + self.worker.log_tail()
        )
        answer = self.collector.records[self.results][-1]
        result = answer.result()
        assert result.id == rid and result.status == "ok", (rid, result.error)
        return meta.timestamp, answer.timestamp_ms

    async def measured(self, kind: str, producer: AIOKafkaProducer, model: str,
                       x: np.ndarray) -> tuple[int, int]:  # fmt: skip
        before = await asyncio.to_thread(self.loads_so_far)
        sent, answered = await self.ask(producer, model, x)
        after = await asyncio.to_thread(self.loads_so_far)
        self.samples.setdefault(kind, []).append(float(answered - sent))
        self.loads.setdefault(kind, []).append(after - before)
        return sent, answered


async def _round(c: Contender, producer: AIOKafkaProducer, x: np.ndarray,
                 args: argparse.Namespace) -> None:  # fmt: skip
    # The first probe's model evicted: the other one asked for first.
    await c.ask(producer, MODELS[1], x)
    for i in range(args.probes):
        model = MODELS[i % 2]
        await asyncio.sleep(args.pause)
        await c.measured("cold", producer, model, x)
        await asyncio.sleep(args.pause)
        await c.measured("warm", producer, model, x)
    await asyncio.sleep(args.pause)
    for _ in range(args.pairs):
        # Loads counted around the pair, not between its requests: the turn
        # from a's answer to b's request is this process's alone.
        before = await asyncio.to_thread(c.loads_so_far)
        a_sent, a_answered = await c.ask(producer, "a", x)
        b_sent, b_answered = await c.ask(producer, "b", x)
        after = await asyncio.to_thread(c.loads_so_far)
        c.samples.setdefault("cycle_request", []).extend(
            [float(a_answered - a_sent), float(b_answered - b_sent)])  # fmt: skip
        c.samples.setdefault("cycle", []).append(float(b_answered - a_sent))
        c.loads.setdefault("cycle", []).append(after - before)


def _worker_loads(c: Contender) -> dict[str, Any]:
    """The worker's account of its loads by demand after start-up (its log lines)."""
    lines = Path(c.worker.log_path).read_text().splitlines()
    events = [json.loads(line) for line in lines if '"model_loaded"' in line]
    events = [e for e in events if e.get("reason") in ("demand", "backlog")]
    seconds = [e["seconds"] * 1e3 for e in events]
    reasons: dict[str, int] = {}
    for e in events:
        reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
    m = c.worker.metrics()
    count = m.get("infer_model_load_seconds_count", 0.0)
    return {"loads": len(events), "reasons": reasons, "seconds": _percentiles(seconds),
            "seconds_ms": seconds,
            "size_mib": sorted({e["size_mib"] for e in events}),
            "used_mib_max": max((e["used_mib"] for e in events), default=None),
            "histogram_mean_ms": round(m.get("infer_model_load_seconds_sum", 0.0) / count * 1e3,
                                       1) if count else None,
            "evictions": sum(v for k, v in m.items()
                             if k.startswith("infer_model_evictions_total{"))}  # fmt: skip


def _ratio(num: Sequence[float], den: Sequence[float], q: float) -> float | None:
    if not num or not den:
        return None
    return round(float(np.percentile(num, q)) / max(float(np.percentile(den, q)), 1.0), 2)


async def _size(bs: str, tmp: Path, mib: int, args: argparse.Namespace) -> dict[str, Any]:
    width = WIDTH[mib]
    repo = tmp / f"m{mib}"
    for seed, name in enumerate(MODELS, start=1):
        (repo / name / "1").mkdir(parents=True)
        _mlp(repo / name / "1" / "model.onnx", seed, width)

    async def contender(name: str, budget_mb: int) -> Contender:
        prefix = f"demand{mib}.{name}"
        topics = {m: f"{prefix}.{m}" for m in MODELS}
        results = f"{prefix}.results"
        stamped = [*topics.values(), results]
        await create_topics(bs, {**{t: 1 for t in stamped}, f"{prefix}.dlq": 1},
                            {t: STAMPED for t in stamped})  # fmt: skip
        own = tmp / f"{prefix}.repo"  # the same files, each model on this worker's topic
        for m in MODELS:
            (own / m / "1").mkdir(parents=True)
            os.link(repo / m / "1" / "model.onnx", own / m / "1" / "model.onnx")
            (own / m / "model.toml").write_text(f'topics = ["{topics[m]}"]\n')
        w = spawn_worker(bs, input_topics=list(topics.values()), output_topic=results,
                         dlq_topic=f"{prefix}.dlq", group_id=prefix,
                         extra_env={"INFER_WORKER_REPOSITORY__PATH": str(own),
                                    "INFER_WORKER_REPOSITORY__ON_DEMAND": "true",
                                    "INFER_WORKER_LIMITS__MAX_MODELS_MEMORY_MB": str(budget_mb),
                                    "INFER_WORKER_LOGGING__LEVEL": "info"})  # fmt: skip
        c = Collector(bs, [results])
        await c.start()
        return Contender(name, w, topics, results, c, budget_mb)

    holding = await contender("holding", ROOMY_MB)
    contenders = [holding]
    try:
        ready = await asyncio.to_thread(
            holding.worker.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2,
            120.0, "assignment")  # fmt: skip
        both = ready["infer_models_memory_used_bytes"] / 2**20
        budget = args.budget_mb or int(1.5 * both / 2)
        evicting = await contender("evicting", budget)
        contenders.append(evicting)
        await asyncio.to_thread(
            evicting.worker.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2,
            120.0, "assignment")  # fmt: skip
        producer = await started(AIOKafkaProducer(**connect_kwargs(bs), acks="all", linger_ms=0,
                                                  max_request_size=16 * 2**20))  # fmt: skip
        x = np.random.default_rng(68).normal(size=width).astype(np.float32)
        try:
            for r in range(args.rounds):
                for c in (evicting, holding) if r % 2 == 0 else (holding, evicting):
                    await _round(c, producer, x, args)
                print(f"  {mib} MiB round {r + 1} done", file=sys.stderr, flush=True)
        finally:
            await producer.stop()
        loads = {c.name: _worker_loads(c) for c in contenders}
    finally:
        for c in contenders:
            code = c.worker.terminate()
            await c.collector.stop()
            assert code == 0, c.worker.log_tail()
    e, h = evicting, holding
    assert all(n >= 1 for n in e.loads["cold"]), f"a cold probe found its model loaded: {e.loads}"
    assert all(n >= 2 for n in e.loads["cycle"]), f"a cycle loaded fewer than two: {e.loads}"
    assert not any(n for v in h.loads.values() for n in v), f"the baseline loaded: {h.loads}"
    cold_extra = [c - w for c, w in zip(e.samples["cold"], e.samples["warm"], strict=True)]
    out = {
        "size_mib": mib, "width": width, "measured_mib_both_at_start": round(both, 1),
        "budget_mb": {"evicting": budget, "holding": ROOMY_MB},
        "first_answer": {
            "evicting_cold": _percentiles(e.samples["cold"]),
            "evicting_warm": _percentiles(e.samples["warm"]),
            "holding": _percentiles(h.samples["cold"] + h.samples["warm"]),
            "cold_over_warm_p50": _ratio(e.samples["cold"], e.samples["warm"], 50),
            "cold_over_holding_p50": _ratio(e.samples["cold"], h.samples["cold"], 50),
            "cold_minus_warm_ms": _percentiles(cold_extra),
            # What a load costs a request beyond the worker's own count of it.
            "beyond_load_p50_ms": round(float(np.median(cold_extra)) - float(np.median(
                loads["evicting"]["seconds_ms"])), 1) if loads["evicting"]["seconds_ms"] else None,
            "samples_ms": {"evicting_cold": e.samples["cold"],
                           "evicting_warm": e.samples["warm"],
                           "holding": h.samples["cold"] + h.samples["warm"]},
        },
        "cycle": {
            "evicting": {"request": _percentiles(e.samples["cycle_request"]),
                         "cycle": _percentiles(e.samples["cycle"])},
            "holding": {"request": _percentiles(h.samples["cycle_request"]),
                        "cycle": _percentiles(h.samples["cycle"])},
            "request_over_holding_p50": _ratio(e.samples["cycle_request"],
                                               h.samples["cycle_request"], 50),
            "request_over_holding_p99": _ratio(e.samples["cycle_request"],
                                               h.samples["cycle_request"], 99),
            "cycle_over_holding_p50": _ratio(e.samples["cycle"], h.samples["cycle"], 50),
        },
        "worker_load": loads,
    }  # fmt: skip
    print(f"  {json.dumps({k: out[k] for k in ('size_mib', 'budget_mb')})}", file=sys.stderr)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started_at = time.monotonic()
    with (EmbeddedBroker() if args.broker == "embedded" else KafkaCluster(1) as broker,
          tempfile.TemporaryDirectory() as tmp):  # fmt: skip
        sizes = [await _size(broker.bootstrap, Path(tmp), mib, args) for mib in args.sizes]
    return {"broker": args.broker, "rounds": args.rounds, "probes": args.probes,
            "pairs": args.pairs, "pause_s": args.pause, "cpus": os.cpu_count(),
            "seconds": round(time.monotonic() - started_at, 1), "sizes": sizes}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=("embedded", "kafka"), default="embedded")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], choices=sorted(WIDTH))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--probes", type=int, default=4, help="cold/warm pairs a round")
    parser.add_argument("--pairs", type=int, default=15, help="a, b requests a round's cycle")
    parser.add_argument("--pause", type=float, default=0.3, help="seconds before each probe")
    parser.add_argument(
        "--budget-mb",
        type=int,
        default=0,
        help="the evicting worker's budget (0: 1.5x one model as measured)",
    )
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.model_demand"):
        summary = asyncio.run(run(args))
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
