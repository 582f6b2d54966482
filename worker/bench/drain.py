"""The worker drain (``worker_img_s``): ``run --procs N`` in a fresh group drains
the backlog, and every request must be answered ``ok``.

The rate is the drain's steady state. Its clock starts at the first result with
one process; with several, once every member holds its partitions (a member
that finishes starting first drains alone until the others join, and
rebalances pause them all), so the figure is what N members sustain together.
Of the results after that, the first and last ``STEADY_SKIP`` are left out:
the first are warm-up (first fetches, caches, the pipeline filling), the last
the partitions running dry one by one. The mean batch comes from the members'
Prometheus metrics over the same span (to a sampling interval), the GPU busy
fraction from NVML's utilisation sampled during it (None without NVML or for a
CPU model).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from worker.app.plan import RunPlan
from worker.bench.ceiling import arrivals_after
from worker.bench.options import BenchError
from worker.config import Settings
from worker.ops.processes import WorkerProcess, scrape
from worker.ops.topics import Collected, Collector

# How often member metrics and NVML are sampled during the drain, seconds.
SAMPLE_INTERVAL: Final = 0.1
# The fraction of the drain's results left out at each end (warm-up, run-out).
STEADY_SKIP: Final = 0.1


def all_joined(assigned: Sequence[int], partitions: int) -> bool:
    """Every member holds partitions (as many as can: with more members than
    partitions, some hold none) and together they hold them all once."""
    holding = sum(1 for a in assigned if a > 0)
    return sum(assigned) == partitions and holding == min(len(assigned), partitions)


@dataclass(frozen=True)
class Sample:
    """The group and the GPU at one moment of the drain."""

    at: float  # monotonic
    assigned: tuple[int, ...]  # partitions per member (0 where unreachable)
    batch_sum: float  # infer_batch_size_sum over the members
    batch_count: float
    gpu_busy: float | None  # NVML utilisation, 0..1; None without NVML
    # Per member, the GPU memory it holds (its infer_gpu_process_memory_bytes);
    # None where it publishes none (a CPU model, no NVML, not listed by NVML).
    gpu_memory: tuple[float | None, ...] = ()


def joined_at(samples: Sequence[Sample], partitions: int) -> Sample | None:
    """The first sample at which the whole group held its partitions."""
    return next((s for s in samples if all_joined(s.assigned, partitions)), None)


def busy_fraction(samples: Iterable[Sample], start: float, end: float) -> float | None:
    """Mean NVML utilisation of the samples taken in [start, end]; None if none."""
    values = [s.gpu_busy for s in samples if start <= s.at <= end and s.gpu_busy is not None]
    return round(float(np.mean(values)), 4) if values else None


class GroupMonitor:
    """Samples every member's metrics (and NVML, when given) while a drain runs.

    ``run --procs N``'s members serve metrics on consecutive ports; a member not
    up yet counts as holding no partitions."""

    def __init__(self, worker: WorkerProcess, procs: int, nvml: Any = None) -> None:
        self.worker, self.procs, self.nvml = worker, procs, nvml
        self.samples: list[Sample] = []

    def sample(self) -> Sample:
        assigned, batch_sum, batch_count = [], 0.0, 0.0
        memory: list[float | None] = []
        for i in range(self.procs):
            try:
                m = scrape(self.worker.metrics_port + i, timeout=1.0)
            except OSError:
                assigned.append(0)
                memory.append(None)
                continue
            assigned.append(int(m.get("infer_assigned_partitions", 0)))
            batch_sum += m.get("infer_batch_size_sum", 0.0)
            batch_count += m.get("infer_batch_size_count", 0.0)
            memory.append(process_gpu_memory(m))
        busy = None
        if self.nvml is not None:
            try:
                busy = self.nvml.sample().utilization_ratio
            except self.nvml.error:
                self.nvml = None  # stop asking; the fraction uses what was sampled
        return Sample(time.monotonic(), tuple(assigned), batch_sum, batch_count, busy,
                      tuple(memory))  # fmt: skip

    async def run(self) -> None:
        while True:
            self.samples.append(await asyncio.to_thread(self.sample))
            await asyncio.sleep(SAMPLE_INTERVAL)


def process_gpu_memory(metrics: Mapping[str, float]) -> float | None:
    """A member's own GPU memory from its scraped metrics (every device's series)."""
    held = [v for k, v in metrics.items() if k.startswith("infer_gpu_process_memory_bytes")]
    return sum(held) if held else None


def peak_gpu_memory(samples: Sequence[Sample]) -> list[float | None]:
    """Per member, the most GPU memory it held in any sample (None: never published)."""
    members = max((len(s.gpu_memory) for s in samples), default=0)
    peaks: list[float | None] = [None] * members
    for s in samples:
        for i, held in enumerate(s.gpu_memory):
            if held is not None:
                current = peaks[i]
                peaks[i] = held if current is None else max(current, held)
    return peaks


def open_nvml(settings: Settings) -> tuple[Any, str | None]:
    """An NVML handle on the run's GPU, or None and the reason."""
    if RunPlan.of(settings).device == "cpu":
        return None, "the model runs on the CPU"
    from worker.compute.gpu.monitor import NvmlDevice, NvmlUnavailable, cuda_pci_bus_id

    device = settings.gpu.device
    try:
        return NvmlDevice(device, cuda_pci_bus_id(device)), None
    except NvmlUnavailable as exc:
        return None, str(exc)


@dataclass
class WorkerDrain:
    rate: float  # results/s over the steady window (see the module docstring)
    first_to_last_rate: float
    seconds: float  # the clock's start (first result or group formed) to the last result
    steady_seconds: float  # the steady window
    mean_batch: float
    gpu_busy: float | None
    join_seconds: float  # first result -> the whole group holding its partitions
    # Per member, the most GPU memory it held during the drain (bytes; None: unknown).
    gpu_memory_per_process: tuple[float | None, ...] = ()


def steady_window(times: Sequence[float], start: float) -> tuple[float, float, int]:
    """(from, to, results counted) of the steady window: among the results that
    arrived after ``start`` (sorted), the span between the one ``STEADY_SKIP``
    of the way in and the one as far from the end, counting those after the
    first instant (its results, a whole batch, came before any interval)."""
    after = sorted(t for t in times if t > start)
    if not after:
        return start, start, 0
    skip = int(len(after) * STEADY_SKIP)
    lo, hi = after[skip], after[len(after) - 1 - skip]
    return lo, hi, arrivals_after(after, lo) - arrivals_after(after, hi)


def _at_or_before(samples: Sequence[Sample], t: float) -> Sample | None:
    return next((s for s in reversed(samples) if s.at <= t), None)


def score_drain(
    results: Sequence[Collected], samples: Sequence[Sample], procs: int, partitions: int,
    final: Sample,
) -> WorkerDrain:  # fmt: skip
    """The drain's figures from its results and the samples taken during it
    (``final``: the members' metrics once it was over)."""
    times = sorted(r.received_at for r in results)
    first, last = times[0], times[-1]
    whole = arrivals_after(times, first) / (last - first) if last > first else 0.0
    start = first
    if procs > 1:
        joined = joined_at(samples, partitions)
        if joined is None or joined.at >= last:
            raise BenchError(
                f"the backlog was drained before all {procs} processes held their "
                f"partitions; send more records (--records)"
            )
        start = max(first, joined.at)
    lo, hi, counted = steady_window(times, start)
    if hi <= lo:
        # A small backlog can arrive in so few reads that the trimmed window holds
        # one instant: then the whole span from ``start`` is the window (its rate,
        # batches and seconds), and the summary's steady seconds are not 0.
        lo, hi, counted = start, last, arrivals_after(times, start)
    base = _at_or_before(samples, lo)
    end = next((s for s in samples if s.at >= hi), final)
    batches = end.batch_count - (base.batch_count if base else 0.0)
    rows = end.batch_sum - (base.batch_sum if base else 0.0)
    rate = counted / (hi - lo) if hi > lo else 0.0
    if rate <= 0.0:
        raise BenchError(
            f"all {len(times)} results arrived at once: no drain rate can be measured; "
            "send more records (--records)"
        )
    return WorkerDrain(
        rate=rate,
        first_to_last_rate=whole,
        seconds=last - start,
        steady_seconds=hi - lo,
        mean_batch=rows / batches if batches > 0 else 0.0,
        gpu_busy=busy_fraction(samples, lo, hi),
        join_seconds=start - first,
        gpu_memory_per_process=tuple(peak_gpu_memory([*samples, final])),
    )


class _Answers:
    """``Collector.collect``'s stop condition for the drain: every request key
    answered on the results topic, a DLQ record, or the worker gone."""

    def __init__(self, topics: Mapping[str, str], keys: set[bytes], worker: WorkerProcess):
        self.topics, self.keys, self.worker = topics, keys, worker
        self.answered: set[bytes | None] = set()
        self._seen = 0

    def __call__(self, collector: Collector) -> bool:
        results = collector.records[self.topics["results"]]
        self.answered.update(r.record_key for r in results[self._seen :])
        self._seen = len(results)
        return (
            self.keys <= self.answered
            or collector.count(self.topics["dlq"]) > 0
            or self.worker.proc.poll() is not None
        )


async def drain_worker(
    procs: int,
    partitions: int,
    topics: Mapping[str, str],
    worker: WorkerProcess,
    collector: Collector,
    keys: set[bytes],
    nvml: Any,
) -> WorkerDrain:
    """Wait for ``worker`` (started on ``topics``, its backlog already there) to
    answer every key in ``keys``, sampling the group meanwhile; score the drain."""
    monitor = GroupMonitor(worker, procs, nvml)
    sampling = asyncio.create_task(monitor.run())
    answers = _Answers(topics, keys, worker)
    try:
        # Start-up (engine warm-up, compilation) is part of the wait, not the rate.
        await collector.collect(answers, 900.0 + len(keys) / 100)
    finally:
        sampling.cancel()
    if not keys <= answers.answered:
        raise BenchError(
            f"the worker answered {len(keys & answers.answered)} of {len(keys)} requests "
            f"(DLQ: {collector.count(topics['dlq'])}); its log:\n{worker.log_tail()}"
        )
    results = collector.records[topics["results"]]
    bad = [r for r in results if r.result().status != "ok"]
    if bad:
        error = bad[0].result().error
        raise BenchError(f"{len(bad)} results were errors, e.g. {error}")
    final = await asyncio.to_thread(monitor.sample)
    return score_drain(results, monitor.samples, procs, partitions, final)
