"""``infer-worker bench --sweep``: the tuning loop.

A grid of ``batching.max_batch_size`` x ``batching.max_queue_delay_ms`` is run
against open-loop Poisson arrivals at several rates (what Triton's model analyzer
does, simply): one embedded broker for the whole sweep, one worker process per
setting, each rate sent for ``duration`` seconds on that worker
(``openloop.send_open_loop``). The recommendation is ``recommend.best_setting``;
the printed lines, the plot and the JSON are ``sweep_report``'s. Stopped by
SIGTERM or SIGINT, it kills the broker and the worker before it exits
(``worker.ops.children``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from worker.bench.openloop import (
    BATCH_KEY,
    DELAY_KEY,
    Setting,
    SweepPoint,
    number,
    send_open_loop,
)
from worker.bench.options import SweepOptions
from worker.bench.payloads import request_records
from worker.bench.recommend import recommendation_text
from worker.bench.sweep_report import (
    HEADER,
    Skipped,
    point_line,
    skipped_line,
    sweep_summary,
    write_outputs,
)
from worker.config import Settings, load_settings
from worker.contract import Tensor
from worker.flow.errors import ConfigError, WorkerError
from worker.ops.broker import EmbeddedBroker
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import WorkerProcess, override_env, spawn_on_fresh_topics
from worker.ops.samples import labelled_samples
from worker.ops.topics import Collector

# Requests sent (at the lowest rate) after a worker starts and before anything is
# measured: first engine runs, connections, the first fetches.
WARMUP_REQUESTS = 100


class SweepError(WorkerError):
    code = "sweep_failed"


def check_options(opts: SweepOptions) -> Settings:
    """Refuse a grid the worker would refuse, before anything starts; returns the
    settings of the first grid point (for the banner)."""
    if not (opts.batch_sizes and opts.delays and opts.rates):
        raise ConfigError("--batch-sizes, --delays and --rates need at least one value each")
    if any(not (r > 0 and np.isfinite(r)) for r in opts.rates):
        raise ConfigError(f"--rates: every rate must be > 0 requests/s, got {opts.rates}")
    if not opts.duration > 0:
        raise ConfigError(f"--duration: must be > 0 seconds, got {opts.duration}")
    if not opts.slo_p99_ms > 0:
        raise ConfigError(f"--slo-p99-ms: must be > 0, got {opts.slo_p99_ms}")
    if opts.partitions < 1:
        raise ConfigError(f"--partitions: must be >= 1, got {opts.partitions}")
    swept = {BATCH_KEY, DELAY_KEY} & set(opts.overrides)
    if swept:
        raise ConfigError(f"--set {sorted(swept)[0]}: swept by --sweep; use --batch-sizes/--delays")
    first: Settings | None = None
    for setting in opts.settings():
        overrides = opts.worker_overrides("infer.requests")
        s = load_settings(env=override_env({**overrides, **setting.overrides()}))
        first = first or s
    assert first is not None
    if opts.pipeline is not None and opts.pipeline not in first.pipelines:
        raise ConfigError(f"--pipeline {opts.pipeline!r}: no [pipelines.{opts.pipeline}] in "
                          f"the settings (define it with --set pipelines.NAME.KEY=...)")
    return first


def _batch_totals(worker: WorkerProcess) -> tuple[float, float]:
    m = worker.metrics()
    return m.get("infer_batch_size_sum", 0.0), m.get("infer_batch_size_count", 0.0)


@dataclass
class _Run:
    """One worker (one setting) on its own topics."""

    broker: EmbeddedBroker
    worker: WorkerProcess
    collector: Collector
    topics: dict[str, str]
    setting: Setting
    images: Sequence[np.ndarray]
    opts: SweepOptions

    async def measure(self, tag: str, rate: float, n: int) -> SweepPoint:
        inputs = [Tensor.from_numpy(image) for image in self.images]
        records = request_records("image", inputs, tag, n)
        sum0, count0 = await asyncio.to_thread(_batch_totals, self.worker)
        point = SweepPoint(self.setting.max_batch_size, self.setting.max_queue_delay_ms, rate, n)
        await send_open_loop(
            self.broker.bootstrap, self.collector, self.topics, records, point,
            prefix=f"{tag}-".encode(), partitions=self.opts.partitions,
        )  # fmt: skip
        sum1, count1 = await asyncio.to_thread(_batch_totals, self.worker)
        if count1 > count0:
            point.mean_batch_size = (sum1 - sum0) / (count1 - count0)
        return point


async def _sweep_setting(
    broker: EmbeddedBroker,
    index: int,
    setting: Setting,
    images: Sequence[np.ndarray],
    opts: SweepOptions,
    report: Callable[[SweepPoint], None],
) -> tuple[list[SweepPoint], list[Skipped]]:
    prefix = f"sweep.{index}"
    overrides = opts.worker_overrides(f"{prefix}.requests")  # spawn_on_fresh_topics' name
    topics, worker = await spawn_on_fresh_topics(
        broker.bootstrap,
        prefix,
        opts.partitions,
        group_id=f"sweep-{index}",
        extra_env={
            "INFER_WORKER_LOGGING__LEVEL": "warning",
            **override_env({**overrides, **setting.overrides()}),
        },
    )
    assert topics["requests"] == f"{prefix}.requests"
    collector = Collector(broker.bootstrap, [topics["results"], topics["dlq"]])
    points: list[SweepPoint] = []
    skipped: list[Skipped] = []
    rates = sorted(opts.rates)
    try:
        try:
            await asyncio.to_thread(
                worker.wait_until,
                lambda m: m.get("infer_assigned_partitions", 0) >= opts.partitions,
                60.0,
                "partition assignment",
            )
        except (RuntimeError, TimeoutError) as exc:
            raise SweepError(f"{setting.label()}: the worker did not start: {exc}") from exc
        await collector.start()
        run = _Run(broker, worker, collector, topics, setting, images, opts)
        await run.measure(f"s{index}-warmup", rates[0], WARMUP_REQUESTS)
        for j, rate in enumerate(rates):
            point = await run.measure(f"s{index}-r{j}", rate, max(1, round(rate * opts.duration)))
            points.append(point)
            report(point)
            if not point.sustained:
                # Higher rates cannot be sustained either; the curve has its knee.
                skipped += [
                    Skipped(
                        setting.max_batch_size, setting.max_queue_delay_ms, r,
                        f"not sustained at {number(rate)}/s",
                    )
                    for r in rates[j + 1 :]
                ]  # fmt: skip
                break
        code = await asyncio.to_thread(worker.terminate)
        if code != 0:
            print(f"  {setting.label()}: worker exited with {code}", file=sys.stderr)
    finally:
        worker.kill()
        await collector.stop()
    return points, skipped


async def _run(opts: SweepOptions) -> int:
    settings = check_options(opts)
    grid = opts.settings()
    served = (f"pipeline {opts.pipeline} (end to end)" if opts.pipeline else
              f"model {settings.model.path} on {settings.model.backend}")  # fmt: skip
    print(
        f"infer-worker bench --sweep: {len(grid)} settings x {len(opts.rates)} rates, "
        f"{number(opts.duration)} s of open-loop Poisson arrivals each; {served}, embedded broker, "
        f"{opts.partitions} partitions, one worker process; SLO p99 <= "
        f"{number(opts.slo_p99_ms)} ms",
        flush=True,
    )
    print(HEADER, flush=True)
    started = time.monotonic()
    images = [s.image for s in labelled_samples(3)]  # 8x8, 16x16 and 24x24 digits
    points: list[SweepPoint] = []
    skipped: list[Skipped] = []

    def report(p: SweepPoint) -> None:
        print(point_line(p), flush=True)

    with EmbeddedBroker() as broker:
        for index, setting in enumerate(grid):
            got, missed = await _sweep_setting(broker, index, setting, images, opts, report)
            points += got
            skipped += missed
    wall = time.monotonic() - started
    for s in skipped:
        print(skipped_line(s))
    lines, chosen, meets = recommendation_text(points, opts.slo_p99_ms)
    print("\n".join(lines))
    summary = sweep_summary(opts, points, skipped, chosen, meets, wall)
    write_outputs(opts, summary, points, chosen)
    print(f"sweep: {wall:.0f} s")
    return 0 if meets else 1


def run_sweep(opts: SweepOptions) -> int:
    """0: a setting meets the SLO (printed with its config lines); 1: none does
    (the closest is printed); configuration errors raise ConfigError."""
    with children_die_with_this_process("bench --sweep"):
        return asyncio.run(_run(opts))
