"""The two measurements ``benchmarks.gpu_models`` and ``benchmarks.gpu_pipeline``
make on a running worker, one topic at a time: a drain (img/s at steady state,
the GPU busy fraction meanwhile) and a paced run (open-loop Poisson arrivals,
end-to-end and in-worker latency). Both read one shared Collector and count only
the answers whose keys carry their own prefix, so several phases run on one
worker and one results topic without a fresh reader each. The scoring is the
bench's own (``worker.bench.drain``, ``worker.bench.openloop``). Benchmark code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu_setups import percentiles
from worker.bench.drain import GroupMonitor, busy_fraction, steady_window
from worker.bench.openloop import SweepPoint, send_open_loop
from worker.bench.options import BenchError
from worker.ops.processes import WorkerProcess
from worker.ops.topics import Collected, Collector, produce_all

Records = list[tuple[bytes | None, bytes]]


@dataclass(frozen=True)
class Topics:
    """One worker's topics: the results and DLQ every phase reads."""

    results: str
    dlq: str

    def for_requests(self, requests: str) -> dict[str, str]:
        return {"requests": requests, "results": self.results, "dlq": self.dlq}


def answers(collector: Collector, topics: Topics, prefix: bytes) -> list[Collected]:
    """The results (and DLQ records) whose keys start with ``prefix``."""
    return [r for t in (topics.results, topics.dlq) for r in collector.records.get(t, [])
            if (r.record_key or b"").startswith(prefix)]  # fmt: skip


class _Count:
    """``Collector.collect``'s stop condition: ``expect`` answers with ``prefix``,
    counted on what arrived since the last call, or the worker gone."""

    def __init__(self, topics: Topics, prefix: bytes, expect: int, worker: WorkerProcess):
        self.topics, self.prefix, self.expect, self.worker = topics, prefix, expect, worker
        self.count = 0
        self._seen: dict[str, int] = {}

    def __call__(self, c: Collector) -> bool:
        for t in (self.topics.results, self.topics.dlq):
            records = c.records.get(t, [])
            start = self._seen.get(t, 0)
            self.count += sum(1 for r in records[start:]
                              if (r.record_key or b"").startswith(self.prefix))  # fmt: skip
            self._seen[t] = len(records)
        return self.count >= self.expect or self.worker.proc.poll() is not None


async def wait_answers(collector: Collector, topics: Topics, prefix: bytes, expect: int,
                       worker: WorkerProcess, timeout: float) -> None:  # fmt: skip
    """Until ``expect`` answers with ``prefix`` arrived; BenchError otherwise."""
    count = _Count(topics, prefix, expect, worker)
    await collector.collect(count, timeout)
    if count.count < expect:
        raise BenchError(f"{count.count} of {expect} {prefix.decode()!r} requests answered in "
                         f"{timeout:g} s; the worker's log:\n{worker.log_tail()}")  # fmt: skip


async def drain(
    bootstrap: str, collector: Collector, topics: Topics, worker: WorkerProcess,
    prefix: bytes, records: Records, nvml: Any, *, produce_to: str | None = None,
    partitions: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Answers to ``records`` (keys starting with ``prefix``), already in their topic,
    or produced to ``produce_to`` now (while the worker serves: then the rate is
    at most the producer's, and says so); every one must be ``ok``."""
    monitor = GroupMonitor(worker, 1, nvml)
    sampling = asyncio.create_task(monitor.run())
    producing = None
    if produce_to is not None:
        producing = asyncio.create_task(produce_all(
            bootstrap, produce_to, records, partition_of=lambda i: i % partitions))  # fmt: skip
    try:
        await wait_answers(collector, topics, prefix, len(records), worker,
                           600.0 + len(records) / 100)  # fmt: skip
        if producing is not None:
            await producing
    finally:
        sampling.cancel()
    got = answers(collector, topics, prefix)
    bad = [r for r in got if r.result().status != "ok"]
    if bad:
        raise BenchError(f"{len(bad)} of {len(got)} {prefix.decode()!r} answers were errors, "
                         f"e.g. {bad[0].result().error}")  # fmt: skip
    times = sorted(r.received_at for r in got)
    lo, hi, counted = steady_window(times, times[0])
    if hi <= lo:  # a backlog read in so few fetches that the window is one instant
        lo, hi, counted = times[0], times[-1], len(times) - 1
    rate = counted / (hi - lo) if hi > lo else 0.0
    return {
        "records": len(records),
        "worker_img_s": round(rate, 1),
        "worker_first_to_last_img_s": round((len(times) - 1) / (times[-1] - times[0]), 1)
        if times[-1] > times[0] else None,
        "worker_steady_s": round(hi - lo, 3),
        "gpu_busy": busy_fraction(monitor.samples, lo, hi),
        "produced_while_serving": produce_to is not None,
    }


async def paced(
    bootstrap: str, collector: Collector, topics: Topics, requests_topic: str,
    records: Records, prefix: bytes, rate: float, partitions: int,
) -> dict[str, Any]:  # fmt: skip
    """``records`` (keys starting with ``prefix``) sent open-loop at ``rate`` to
    ``requests_topic``: end-to-end latency (sent -> result read here) and the
    worker's own (the results' ``timing_us.total``), and the window it spanned."""
    point = SweepPoint(0, 0.0, rate, len(records))
    got = await send_open_loop(
        bootstrap, collector, topics.for_requests(requests_topic), records, point,
        prefix=prefix, partitions=partitions,
    )  # fmt: skip
    inside = [r.result().timing_us.get("total", 0) / 1000.0 for r in got
              if r.result().status == "ok"]  # fmt: skip
    mine = answers(collector, topics, prefix)
    return {
        "rate": round(rate, 1),
        "offered": round(point.offered, 1),
        "sent": point.sent,
        "answered": point.answered,
        "errors": point.errors,
        "sustained": point.sustained,
        "p50_ms": round(point.p50_ms, 3),
        "p99_ms": round(point.p99_ms, 3),
        "max_ms": round(point.max_ms, 3),
        "worker": percentiles(inside),
        "window": window(mine),
    }


def window(got: Sequence[Collected]) -> tuple[float, float]:
    """(first, last) arrival of these answers, monotonic."""
    times = [r.received_at for r in got]
    return (min(times), max(times)) if times else (0.0, 0.0)
