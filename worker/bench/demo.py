"""``infer-worker demo`` and ``infer-worker bench``.

The demo starts the embedded broker and one worker process, produces a bundled
model's held-out labelled samples as requests over several partitions (the
digits at several image sizes: the worker resizes; with ``--model sentiment``,
review texts: the worker tokenizes), reads every result back, and checks that
the accuracy over the stream equals the offline accuracy of the same ONNX model
on the same inputs (``worker.ops.samples``). ``bench`` then runs the same
requests through the naive one-request-at-a-time baseline on the same broker
and reports the ratio. The baseline is benchmark code, not part of the worker:
it lives in the repository's ``benchmarks/`` folder, and ``bench`` runs it when
started from a checkout.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from worker.ops.broker import EmbeddedBroker
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import (
    WorkerProcess,
    mean_batch_size,
    override_env,
    spawn_on_fresh_topics,
)
from worker.ops.samples import (
    LabelledSet,
    Sample,
    encode_samples,
    labelled_samples,
    labelled_set,
    offline_correct,
)
from worker.ops.topics import Collector, Produced, committed_offsets, produce_all

# Moved to worker.ops.samples (and override_env to worker.ops.processes);
# importable from here as before.
__all__ = [
    "DemoOptions",
    "Sample",
    "encode_samples",
    "labelled_samples",
    "offline_correct",
    "override_env",
    "run_demo",
]


@dataclass
class DemoOptions:
    model: str = "digits"  # a bundled model with labelled samples (samples.DEMO_MODELS)
    repeat: int = 10
    partitions: int = 4
    json_out: str | None = None
    baseline: bool = False
    rate: float = 0.0  # requests/s; 0 = as fast as possible (throughput)
    # Worker settings as dotted keys, e.g. {"batching.max_batch_size": "16"}.
    overrides: dict[str, str] = field(default_factory=dict)
    timeout: float = 300.0


def naive_baseline() -> Path | None:
    """The naive baseline script of the repository checkout we run from, if any."""
    path = Path.cwd() / "benchmarks" / "naive.py"
    return path if path.is_file() else None


def naive_argv(expect: int) -> list[str]:
    script = naive_baseline()
    assert script is not None, "checked before the run"
    return [sys.executable, str(script), "--expect", str(expect)]


@dataclass
class RunStats:
    mode: str
    sent: int
    received: int = 0
    errors: int = 0
    dlq: int = 0
    correct: int = 0
    seconds: float = 0.0
    throughput: float = 0.0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    min_ms: float = 0.0  # below 0: a result matched to the wrong request (fails the demo)
    mean_batch_size: float = 0.0
    batches: int = 0
    committed: int = 0
    worker_exit: int | None = None
    error_codes: dict[str, int] = field(default_factory=dict)


class Progress:
    """A one-line progress bar on a terminal; a line per quarter otherwise."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.tty = sys.stderr.isatty()
        self._last = -1.0

    def __call__(self, collector: Collector) -> None:
        done = collector.count()
        frac = done / self.total if self.total else 1.0
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r  {self.label:<8} [{bar:<30}] {done}/{self.total}")
            if done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif int(frac * 4) > self._last:
            self._last = int(frac * 4)
            print(f"  {self.label}: {done}/{self.total} results", file=sys.stderr, flush=True)


async def _run_once(
    broker: EmbeddedBroker, mode: str, samples: LabelledSet, opts: DemoOptions
) -> RunStats:
    group = f"demo-{mode}"
    overrides = {"model.path": f"builtin:{samples.model}", **opts.overrides}
    topics, worker = await spawn_on_fresh_topics(
        broker.bootstrap,
        f"demo.{mode}",
        opts.partitions,
        group_id=group,
        extra_env={"INFER_WORKER_LOGGING__LEVEL": "warning", **override_env(overrides)},
        argv=None if mode == "worker" else naive_argv(len(samples.records)),
    )
    stats = RunStats(mode=mode, sent=len(samples.records))
    collector = Collector(broker.bootstrap, [topics["results"], topics["dlq"]])
    try:
        produced = await _send_and_collect(worker, collector, topics, samples, opts, mode)
        await _stop(worker, stats, mode)
    finally:
        worker.kill()
        await collector.stop()
    _score(stats, collector, topics, samples, produced)
    offsets = await committed_offsets(broker.bootstrap, group, topics["requests"], opts.partitions)
    stats.committed = sum(max(0, o) for o in offsets.values())
    return stats


async def _send_and_collect(
    worker: WorkerProcess,
    collector: Collector,
    topics: dict[str, str],
    samples: LabelledSet,
    opts: DemoOptions,
    mode: str,
) -> list[Produced]:
    """Produce the samples while collecting, so each result is timestamped when
    it arrives (the worker first owns every partition: no rebalance mid-run)."""
    if mode == "worker":
        await asyncio.to_thread(
            worker.wait_until,
            lambda m: m.get("infer_assigned_partitions", 0) >= opts.partitions,
            60.0,
            "partition assignment",
        )
    await collector.start()
    collecting = asyncio.create_task(
        collector.collect(
            lambda c: c.count() >= len(samples.records),
            opts.timeout,
            Progress(len(samples.records), mode),
        )
    )
    produced = await produce_all(
        collector.bootstrap,
        topics["requests"],
        samples.records,
        partition_of=(
            (lambda i: zlib.crc32(samples.records[i][0] or b"") % opts.partitions)
            if samples.keyed
            else (lambda i: i % opts.partitions)
        ),
        rate=opts.rate,
    )
    if not await collecting:
        print(f"  {mode}: timed out; worker log:\n{worker.log_tail()}", file=sys.stderr)
    return produced


async def _stop(worker: WorkerProcess, stats: RunStats, mode: str) -> None:
    if mode == "worker":
        m = worker.metrics()
        stats.mean_batch_size = mean_batch_size(m)
        stats.batches = int(m.get("infer_batch_size_count", 0))
        stats.worker_exit = await asyncio.to_thread(worker.terminate)
    else:
        stats.worker_exit = await asyncio.to_thread(worker.proc.wait, 60)


def _score(
    stats: RunStats,
    collector: Collector,
    topics: dict[str, str],
    samples: LabelledSet,
    produced: list[Produced],
) -> None:
    """Answers, accuracy, throughput and latency from what was collected."""
    results = collector.records[topics["results"]]
    stats.dlq = collector.count(topics["dlq"])
    stats.received = len(results) + stats.dlq
    # By the request's partition and offset, which its result names: keys repeat
    # (a stateful model's records are keyed by sequence), offsets do not.
    sent_at = {(p.partition, p.offset): p.sent_at for p in produced}
    latencies = []
    labels = samples.labels
    for rec in results:
        res = rec.result()
        if res.status != "ok":
            stats.errors += 1
            code = res.error.code if res.error else "?"
            stats.error_codes[code] = stats.error_codes.get(code, 0) + 1
            continue
        stats.correct += int(samples.predicted(res) == labels.get(res.id, -1))
        sent = sent_at.get((res.source.partition, res.source.offset))
        if sent is not None:
            latencies.append(rec.received_at - sent)
    if results:
        first = min(p.sent_at for p in produced)
        last = max(r.received_at for r in results)
        stats.seconds = last - first
        stats.throughput = len(results) / stats.seconds if stats.seconds > 0 else 0.0
    if latencies:
        stats.min_ms = float(min(latencies) * 1000)
        p50, p95, p99 = np.percentile(np.array(latencies) * 1000, [50, 95, 99])
        stats.p50_ms, stats.p95_ms, stats.p99_ms = float(p50), float(p95), float(p99)
        stats.max_ms = float(max(latencies) * 1000)


def _print_stats(s: RunStats, offline: int, means: str) -> None:
    pct = 100.0 * s.received / s.sent if s.sent else 0.0
    acc = 100.0 * s.correct / s.sent if s.sent else 0.0
    print(f"  [{s.mode}]")
    print(
        f"    results received   {s.received} / {s.sent} ({pct:.1f}%)  "
        f"errors {s.errors} {s.error_codes or ''}  dlq {s.dlq}"
    )
    print(
        f"    accuracy           {acc:.2f}% ({s.correct}/{s.sent}); offline ONNX Runtime "
        f"{100.0 * offline / s.sent:.2f}% ({offline}/{s.sent}) "
        f"{'equal' if s.correct == offline else 'MISMATCH'}"
    )
    print(f"                       ({means})")
    print(
        f"    throughput         {s.throughput:,.0f} requests/s "
        f"({s.seconds:.2f} s from first send to last result)"
    )
    print(
        f"    latency end-to-end p50 {s.p50_ms:.1f} ms  p95 {s.p95_ms:.1f} ms  "
        f"p99 {s.p99_ms:.1f} ms  max {s.max_ms:.1f} ms"
    )
    if s.mode == "worker":
        print(f"    mean batch size    {s.mean_batch_size:.1f} over {s.batches} batches")
    print(f"    committed offsets  {s.committed} / {s.sent}   process exit {s.worker_exit}")


def _problems(s: RunStats, offline: int) -> list[str]:
    """Why a run does not pass: what is missing, wrong, or impossible."""
    problems = []
    if s.received != s.sent:
        problems.append(f"{s.received} of {s.sent} answered")
    if s.correct != offline:
        problems.append(f"accuracy {s.correct} correct, offline {offline}")
    if s.committed != s.sent:
        problems.append(f"{s.committed} of {s.sent} offsets committed")
    if s.worker_exit != 0:
        problems.append(f"process exit {s.worker_exit}")
    if s.min_ms < 0 or s.seconds < 0 or s.throughput < 0:
        problems.append("a negative time (results matched to the wrong requests)")
    return problems


async def _demo(opts: DemoOptions) -> int:
    samples = await asyncio.to_thread(labelled_set, opts.model, opts.repeat)
    offline = samples.offline_correct
    print(
        f"infer-worker demo: {len(samples.records)} {samples.description} "
        f"over {opts.partitions} partitions, embedded broker, model builtin:{samples.model} "
        f"on onnxruntime, "
        + (
            f"open-loop Poisson arrivals at {opts.rate:g} requests/s"
            if opts.rate
            else "sent as fast as possible"
        )
    )
    started = time.monotonic()
    with EmbeddedBroker() as broker:
        runs = [await _run_once(broker, "worker", samples, opts)]
        if opts.baseline and naive_baseline() is not None:
            runs.append(await _run_once(broker, "naive", samples, opts))
        elif opts.baseline:
            print(
                "  naive baseline: skipped (it lives in benchmarks/naive.py of a repository "
                "checkout; run bench from there)",
                file=sys.stderr,
            )
    for s in runs:
        _print_stats(s, offline, samples.accuracy_means)
    summary: dict[str, Any] = {
        "offline_correct": offline,
        "runs": [asdict(s) for s in runs],
        "wall_seconds": time.monotonic() - started,
    }
    if len(runs) > 1 and runs[1].throughput > 0:
        ratio = runs[0].throughput / runs[1].throughput
        summary["throughput_ratio"] = ratio
        print(f"  worker / naive throughput: {ratio:.1f}x")
    if opts.json_out:
        await asyncio.to_thread(Path(opts.json_out).write_text, json.dumps(summary, indent=2))
    problems = [f"{s.mode}: {p}" for s in runs for p in _problems(s, offline)]
    print("demo: OK" if not problems else f"demo: FAILED ({'; '.join(problems)})")
    return 0 if not problems else 1


def run_demo(opts: DemoOptions) -> int:
    with children_die_with_this_process("demo"):
        return asyncio.run(_demo(opts))
