"""Open-loop latency: the worker and its peers at the same Poisson request rate.

    .venv/bin/python -m benchmarks.latency --rate 500 --records 5000 \\
        --peers tight_loop faust_take quix_apply [--json out.json]
    .venv/bin/python -m benchmarks.latency --broker kafka --rate 1000 --records 10000 \\
        --peers --baseline-path ../base --repeat 3     # two versions, same broker

One broker (embedded, or a single-node Apache Kafka with ``--broker kafka``);
each contender gets fresh topics and a fresh group, is
warmed up (a few requests answered before the clock starts: start-up, model
loading and the first group join are not latency), then is sent ``--records``
requests as an open-loop Poisson process of mean rate ``--rate``, seeded, the
same sequence for every contender, whatever the answers do (a closed-loop
sender would slow down with the system and hide its queueing). Latency is a
result's arrival at the collecting client minus its request's send time, both
on this host's monotonic clock. A contender *sustains* the rate when it answers
every request ``ok`` and its throughput is at least 95% of the rate actually
sent (Poisson gaps move that a few percent off ``--rate``). Beside it, the
worker-side latency: the result record's Kafka timestamp minus its request's
(both written by producers on this host: the time from the request's send to
the result's hand-over, without the collecting client's fetch wait).
``--baseline-path DIR`` adds the worker package found in DIR (a ``git worktree``
of another commit) as contender ``baseline``; ``--repeat`` runs every
contender that many times, alternating the order, and reports each run.

Benchmark code: not part of the installed package.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.peers import NAMES as PEERS
from benchmarks.peers import argv as peer_argv
from benchmarks.peers import package_argv
from benchmarks.summary import emit
from devkit.apache_kafka import KafkaCluster
from worker.bench.demo import encode_samples, labelled_samples
from worker.ops.broker import EmbeddedBroker
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import spawn_on_fresh_topics
from worker.ops.topics import Collector, produce_all

_WARM_UP = 32


@dataclass
class Latency:
    name: str
    offered_rate: float
    sent_rate: float  # as actually sent: Poisson gaps move it a few % off the offer
    sent: int
    answered: int
    throughput: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    # Result record timestamp minus request record timestamp (0 where the
    # broker gives no timestamps).
    worker_p50_ms: float = 0.0
    worker_p99_ms: float = 0.0

    @property
    def sustained(self) -> bool:
        return self.answered == self.sent and self.throughput >= 0.95 * self.sent_rate


async def measure(
    bootstrap: str,
    name: str,
    records: list[tuple[bytes | None, bytes]],
    rate: float,
    parts: int,
    env: dict[str, str],
    argv: list[str] | None,
    run: int = 0,
) -> Latency:
    topics, proc = await spawn_on_fresh_topics(
        bootstrap,
        f"lat.{name}.{run}",
        parts,
        group_id=f"lat-{name}-{run}",
        extra_env={"INFER_WORKER_LOGGING__LEVEL": "warning", **env},
        argv=argv,
    )
    collector = Collector(bootstrap, [topics["results"]])
    await collector.start()
    try:
        warm = [(f"warm-{i}".encode(), v) for i, (_, v) in enumerate(records[:_WARM_UP])]
        await produce_all(bootstrap, topics["requests"], warm, partition_of=lambda i: i % parts)
        gone = lambda: proc.proc.poll() is not None  # noqa: E731 - stop waiting on a dead process
        await collector.collect(lambda c: c.count() >= _WARM_UP or gone(), 120)
        if collector.count() < _WARM_UP:
            raise RuntimeError(f"{name}: not answering the warm-up:\n{proc.log_tail()}")
        done = _WARM_UP + len(records)
        collecting = asyncio.create_task(
            collector.collect(
                lambda c: c.count() >= done or gone(),
                len(records) / rate + 60.0,
            )
        )
        produced = await produce_all(
            bootstrap,
            topics["requests"],
            records,
            partition_of=lambda i: i % parts,
            rate=rate,
        )
        await collecting
    finally:
        proc.kill()
        await collector.stop()
    sent_at = {p.key: p.sent_at for p in produced}
    got = [r for r in collector.records[topics["results"]] if r.record_key in sent_at]
    bad = [r for r in got if r.result().status != "ok"]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} results not ok")
    latencies = np.array([r.received_at - sent_at[r.record_key] for r in got]) * 1000.0
    stamped = {p.key: p.timestamp_ms for p in produced}
    worker_side = np.array(
        [
            r.timestamp_ms - stamped[r.record_key]
            for r in got
            if r.timestamp_ms > 0 < stamped[r.record_key]
        ],
        float,
    )
    w50, w99 = np.percentile(worker_side, [50, 99]) if len(worker_side) else (0.0, 0.0)
    first = min(p.sent_at for p in produced)
    sending = max(p.sent_at for p in produced) - first
    span = max(r.received_at for r in got) - first if got else 0.0
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99]) if got else (0.0, 0.0, 0.0)
    return Latency(
        name=name,
        offered_rate=rate,
        sent_rate=round(len(produced) / sending, 1) if sending > 0 else rate,
        sent=len(records),
        answered=len(got),
        throughput=round(len(got) / span, 1) if span > 0 else 0.0,
        p50_ms=round(float(p50), 2),
        p95_ms=round(float(p95), 2),
        p99_ms=round(float(p99), 2),
        max_ms=round(float(latencies.max()), 2) if got else 0.0,
        worker_p50_ms=round(float(w50), 2),
        worker_p99_ms=round(float(w99), 2),
    )


async def run(args: argparse.Namespace) -> list[Latency]:
    samples = labelled_samples(max(1, -(-args.records // 360)))[: args.records]
    records = encode_samples(samples)  # unique keys: latency is matched by key
    names = ["worker", *(["baseline"] if args.baseline_path else []), *args.peers]
    out = []
    with EmbeddedBroker() if args.broker == "embedded" else KafkaCluster(1) as broker:
        for i in range(args.repeat):
            for name in names if i % 2 == 0 else names[::-1]:
                worker = name in ("worker", "baseline")
                env = dict(item.split("=", 1) for item in args.env) if worker else {}
                argv = (
                    None if name == "worker"
                    else package_argv(args.baseline_path)
                    if name == "baseline" else peer_argv(name)
                )  # fmt: skip
                lat = await measure(broker.bootstrap, name, records, args.rate,
                                    args.partitions, env, argv, i)  # fmt: skip
                out.append(lat)
                print(
                    f"  {name:10s} {lat.throughput:8,.0f} rec/s of {args.rate:,.0f} offered, "
                    f"p50 {lat.p50_ms:.1f} p95 {lat.p95_ms:.1f} p99 {lat.p99_ms:.1f} "
                    f"max {lat.max_ms:.1f} ms; worker-side p50 {lat.worker_p50_ms:.1f} "
                    f"p99 {lat.worker_p99_ms:.1f} ms"
                    f"{'' if lat.sustained else '  (NOT sustained)'}",
                    file=sys.stderr,
                    flush=True,
                )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500.0, help="requests/s, Poisson")
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="INFER_WORKER_X=V",
        help="extra worker environment, e.g. INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS=0",
    )
    parser.add_argument("--broker", choices=("embedded", "kafka"), default="embedded")
    parser.add_argument("--baseline-path", help="also run the worker package in this dir")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, alternating")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.baseline_path:
        args.baseline_path = str(Path(args.baseline_path).resolve())
    with children_die_with_this_process("benchmarks.latency"):
        results = asyncio.run(run(args))
    summary = {
        "rate": args.rate,
        "records": args.records,
        "broker": args.broker,
        "worker_env": args.env,
        "results": [{**asdict(r), "sustained": r.sustained} for r in results],
    }
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
