"""``infer-worker bench --sweep``: the tuning loop.

A grid of ``batching.max_batch_size`` x ``batching.max_queue_delay_ms`` is run
against open-loop Poisson arrivals at several rates (what Triton's model analyzer
does, simply): one embedded broker for the whole sweep, one worker process per
setting, each rate sent for ``duration`` seconds on that worker. Every point
records what was offered, what was answered per second, the end-to-end latency
percentiles and the mean batch size. The curves (p99 and p50 latency against
throughput, one line per setting) go to a PNG when matplotlib is installed.

The recommendation is a pure function of the points (``best_setting``), so the
rule is tested on hand-made points: see its docstring.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from worker.config import BatchingConfig, Settings, load_settings
from worker.contract import Request, Tensor, encode_request
from worker.errors import ConfigError, WorkerError
from worker.tools.broker import EmbeddedBroker
from worker.tools.children import children_die_with_this_process
from worker.tools.demo import labelled_samples, override_env
from worker.tools.processes import WorkerProcess, spawn_on_fresh_topics
from worker.tools.topics import Collected, Collector, Produced, produce_all

# A rate is sustained when everything was answered ok and the answers kept up
# with the arrivals: answered/s >= this fraction of the rate actually offered.
SUSTAINED_FRACTION = 0.95
# Requests sent (at the lowest rate) after a worker starts and before anything is
# measured: first engine runs, connections, the first fetches.
WARMUP_REQUESTS = 100
# Beyond sending, how long a rate may take to be answered: max(this, 3 x duration).
DRAIN_SECONDS = 20.0

_BATCH_KEY = "batching.max_batch_size"
_DELAY_KEY = "batching.max_queue_delay_ms"


class SweepError(WorkerError):
    code = "sweep_failed"


@dataclass(frozen=True)
class Setting:
    max_batch_size: int
    max_queue_delay_ms: float

    def overrides(self) -> dict[str, str]:
        return {
            _BATCH_KEY: str(self.max_batch_size),
            _DELAY_KEY: number(self.max_queue_delay_ms),
        }

    def label(self) -> str:
        return f"batch {self.max_batch_size}, delay {number(self.max_queue_delay_ms)} ms"


@dataclass
class SweepPoint:
    """One setting at one arrival rate."""

    max_batch_size: int
    max_queue_delay_ms: float
    rate: float  # target mean arrival rate, requests/s
    sent: int
    answered: int = 0  # ok results
    errors: int = 0  # error results and dead-lettered records
    offered: float = 0.0  # the rate actually sent: sent / (last send - first send)
    throughput: float = 0.0  # answered / (last answer - first send)
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    mean_batch_size: float = 0.0
    seconds: float = 0.0  # first send to last answer
    complete: bool = True  # False: the answers did not all arrive in time

    @property
    def setting(self) -> Setting:
        return Setting(self.max_batch_size, self.max_queue_delay_ms)

    @property
    def sustained(self) -> bool:
        return (
            self.complete
            and self.answered == self.sent
            and self.errors == 0
            and self.throughput >= SUSTAINED_FRACTION * self.offered
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "sustained": self.sustained}


# --- the recommendation (pure) -------------------------------------------------------


def _by_setting(points: Iterable[SweepPoint]) -> dict[Setting, list[SweepPoint]]:
    out: dict[Setting, list[SweepPoint]] = {}
    for p in points:
        out.setdefault(p.setting, []).append(p)
    for pts in out.values():
        pts.sort(key=lambda p: p.rate)
    return out


def qualifying(points: Iterable[SweepPoint], slo_p99_ms: float) -> list[SweepPoint]:
    """The points at which a setting can be run: sustained with p99 <= the SLO,
    there and at every lower rate measured for the same setting (a setting that
    meets the SLO only when batches fill quickly breaks it whenever traffic is
    lighter, which it mostly is)."""
    out = []
    for pts in _by_setting(points).values():
        for p in pts:
            if not (p.sustained and p.p99_ms <= slo_p99_ms):
                break
            out.append(p)
    return out


def best_setting(points: Iterable[SweepPoint], slo_p99_ms: float) -> SweepPoint | None:
    """The point to recommend, or None when no setting meets the SLO.

    The setting that sustains the highest rate with p99 <= ``slo_p99_ms`` (at
    that rate and every lower one, see ``qualifying``); among settings that
    sustain the same rate, the lower p99. Settings are compared by the rate they
    sustain rather than by the measured answers/s, because at a sustained rate
    the answers/s is that rate within the 5% that defines "sustained": the
    difference between two settings there is noise, their p99 is not."""
    ok = qualifying(points, slo_p99_ms)
    if not ok:
        return None
    return min(ok, key=lambda p: (-p.rate, p.p99_ms, p.max_queue_delay_ms, -p.max_batch_size))


def closest_setting(points: Iterable[SweepPoint]) -> SweepPoint | None:
    """When nothing meets the SLO: the sustained point with the lowest p99 (at
    equal p99, the higher rate); when nothing was sustained either, the point
    with the fewest unanswered requests, then the lowest p99."""
    pts = list(points)
    sustained = [p for p in pts if p.sustained]
    if sustained:
        return min(sustained, key=lambda p: (p.p99_ms, -p.rate))
    if pts:
        return min(pts, key=lambda p: (p.sent - p.answered, p.p99_ms, -p.rate))
    return None


def number(x: float) -> str:
    """A setting's value as TOML and the environment read it back: 2, 2.5."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def config_lines(setting: Setting) -> tuple[list[str], list[str]]:
    """The TOML lines and the equivalent environment variables."""
    toml = [
        "[batching]",
        f"max_batch_size = {setting.max_batch_size}",
        f"max_queue_delay_ms = {number(setting.max_queue_delay_ms)}",
    ]
    return toml, [f"{k}={v}" for k, v in override_env(setting.overrides()).items()]


# --- running -------------------------------------------------------------------------


@dataclass
class SweepOptions:
    batch_sizes: list[int] = field(default_factory=lambda: [BatchingConfig().max_batch_size])
    delays: list[float] = field(default_factory=lambda: [0.0, 2.0, 5.0, 10.0])
    rates: list[float] = field(default_factory=lambda: [200.0, 1000.0, 3000.0])
    duration: float = 5.0  # seconds of arrivals per rate
    slo_p99_ms: float = 50.0
    plot: str | None = "sweep.png"
    json_out: str | None = None
    partitions: int = 4
    # Other worker settings for every run, as dotted keys.
    overrides: dict[str, str] = field(default_factory=dict)

    def settings(self) -> list[Setting]:
        return [Setting(b, float(d)) for b in self.batch_sizes for d in self.delays]


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
    swept = {_BATCH_KEY, _DELAY_KEY} & set(opts.overrides)
    if swept:
        raise ConfigError(f"--set {sorted(swept)[0]}: swept by --sweep; use --batch-sizes/--delays")
    first: Settings | None = None
    for setting in opts.settings():
        s = load_settings(env=override_env({**opts.overrides, **setting.overrides()}))
        first = first or s
    assert first is not None
    return first


class _Tally:
    """Counts the answers (results and DLQ records) to one rate's requests, known
    by their key prefix, scanning only what arrived since the last call."""

    def __init__(self, collector: Collector, prefix: bytes, expect: int) -> None:
        self.prefix, self.expect, self.count = prefix, expect, 0
        self._seen = {t: len(collector.records[t]) for t in collector.topics}
        self.start = dict(self._seen)

    def __call__(self, collector: Collector) -> bool:
        for topic, seen in self._seen.items():
            records = collector.records[topic]
            self.count += sum(1 for r in records[seen:] if self._ours(r))
            self._seen[topic] = len(records)
        return self.count >= self.expect

    def _ours(self, record: Collected) -> bool:
        return record.record_key is not None and record.record_key.startswith(self.prefix)

    def answers(self, collector: Collector, topic: str) -> list[Collected]:
        return [r for r in collector.records[topic][self.start[topic] :] if self._ours(r)]


def _encode(images: Sequence[np.ndarray], prefix: str, n: int) -> list[tuple[bytes | None, bytes]]:
    out: list[tuple[bytes | None, bytes]] = []
    for i in range(n):
        rid = f"{prefix}{i}"
        image = images[i % len(images)]
        request = Request(v=1, id=rid, inputs={"image": Tensor.from_numpy(image)})
        out.append((rid.encode(), encode_request(request)))
    return out


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
        records = _encode(self.images, f"{tag}-", n)
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


async def send_open_loop(
    bootstrap: str,
    collector: Collector,
    topics: dict[str, str],
    records: Sequence[tuple[bytes | None, bytes]],
    point: SweepPoint,
    *,
    prefix: bytes,
    partitions: int,
) -> list[Collected]:
    """Send ``records`` (every key starts with ``prefix``) as open-loop Poisson
    arrivals at ``point.rate`` over ``partitions`` while ``collector`` (started,
    reading the results and DLQ topics) gathers their answers; fills in
    ``point`` (answered, errors, offered rate, throughput, latency percentiles,
    complete) and returns the result records of these requests."""
    n = len(records)
    tally = _Tally(collector, prefix, n)
    timeout = n / point.rate + max(DRAIN_SECONDS, 3 * n / point.rate)
    collecting = asyncio.create_task(collector.collect(tally, timeout))
    produced = await produce_all(
        bootstrap,
        topics["requests"],
        records,
        partition_of=lambda i: i % partitions,
        rate=point.rate,
    )
    point.complete = await collecting
    _score(point, tally, collector, topics, produced)
    return tally.answers(collector, topics["results"])


def _score(
    point: SweepPoint,
    tally: _Tally,
    collector: Collector,
    topics: dict[str, str],
    produced: list[Produced],
) -> None:
    sent_at = {p.key: p.sent_at for p in produced}
    latencies = []
    last = None
    for rec in tally.answers(collector, topics["results"]):
        if rec.result().status != "ok" or rec.record_key not in sent_at:
            point.errors += 1
            continue
        point.answered += 1
        latencies.append(rec.received_at - sent_at[rec.record_key])
        last = rec.received_at if last is None else max(last, rec.received_at)
    point.errors += len(tally.answers(collector, topics["dlq"]))
    first, final = min(sent_at.values()), max(sent_at.values())
    point.offered = point.sent / (final - first) if final > first else point.rate
    if last is not None and last > first:
        point.seconds = last - first
        point.throughput = point.answered / point.seconds
    if latencies:
        ms = np.array(latencies) * 1000
        p50, p95, p99 = np.percentile(ms, [50, 95, 99])
        point.p50_ms, point.p95_ms, point.p99_ms = float(p50), float(p95), float(p99)
        point.max_ms = float(ms.max())


@dataclass
class Skipped:
    max_batch_size: int
    max_queue_delay_ms: float
    rate: float
    reason: str


async def _sweep_setting(
    broker: EmbeddedBroker,
    index: int,
    setting: Setting,
    images: Sequence[np.ndarray],
    opts: SweepOptions,
    report: Callable[[SweepPoint], None],
) -> tuple[list[SweepPoint], list[Skipped]]:
    topics, worker = await spawn_on_fresh_topics(
        broker.bootstrap,
        f"sweep.{index}",
        opts.partitions,
        group_id=f"sweep-{index}",
        extra_env={
            "INFER_WORKER_LOGGING__LEVEL": "warning",
            **override_env({**opts.overrides, **setting.overrides()}),
        },
    )
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


# --- reporting -----------------------------------------------------------------------

_HEADER = (
    f"  {'batch':>5} {'delay ms':>8} {'rate/s':>7} {'offered/s':>9} {'answered/s':>10} "
    f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'max ms':>7} {'batch avg':>9}"
)


def point_line(p: SweepPoint) -> str:
    note = "" if p.sustained else "  NOT sustained"
    if p.sent - p.answered:
        note += f" ({p.sent - p.answered} of {p.sent} not answered ok)"
    if p.offered < 0.9 * p.rate:
        note += "  (sender behind the target rate)"
    return (
        f"  {p.max_batch_size:>5} {number(p.max_queue_delay_ms):>8} {p.rate:>7,.0f} "
        f"{p.offered:>9,.0f} {p.throughput:>10,.0f} {p.p50_ms:>7.1f} {p.p95_ms:>7.1f} "
        f"{p.p99_ms:>7.1f} {p.max_ms:>7.1f} {p.mean_batch_size:>9.1f}{note}"
    )


def recommendation_text(
    points: Sequence[SweepPoint], slo_p99_ms: float
) -> tuple[list[str], SweepPoint | None, bool]:
    """The lines to print, the point chosen (best, else closest) and whether it
    meets the SLO."""
    best = best_setting(points, slo_p99_ms)
    chosen = best or closest_setting(points)
    slo = f"p99 <= {number(slo_p99_ms)} ms"
    if chosen is None:
        return ["no point was measured"], None, False
    where = (
        f"{chosen.setting.label()}: {chosen.throughput:,.0f} answered/s at "
        f"{number(chosen.rate)}/s offered, p99 {chosen.p99_ms:.1f} ms "
        f"(p50 {chosen.p50_ms:.1f} ms), mean batch {chosen.mean_batch_size:.1f}"
    )
    if best is not None:
        lines = [
            f"recommended ({slo} at every rate up to the highest sustained): {where}",
            "paste into the worker's TOML config:",
        ]
    else:
        lines = [
            f"NO setting meets {slo} at a sustained rate "
            f"(sustained: answered/s >= {SUSTAINED_FRACTION:.0%} of the offered rate, "
            "every request answered ok).",
            f"closest: {where}",
            "its lines, which do NOT meet the SLO (try lower --rates, a larger "
            "--slo-p99-ms, more worker processes, or a faster backend):",
        ]
    toml, env = config_lines(chosen.setting)
    lines += [f"  {line}" for line in toml] + ["or set in the worker's environment:"]
    lines += [f"  {line}" for line in env]
    return lines, chosen, best is not None


def write_plot(
    points: Sequence[SweepPoint], chosen: SweepPoint | None, slo_p99_ms: float, path: str
) -> None:
    """p99 (solid) and p50 (dashed) latency against answered/s, one line per
    setting across the rates; open markers where the rate was not sustained.
    Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    groups = _by_setting(points)
    colors = [f"C{i % 10}" for i in range(len(groups))]
    for color, (setting, pts) in zip(colors, groups.items(), strict=True):
        x = [p.throughput for p in pts]
        ax.plot(x, [p.p99_ms for p in pts], "-", color=color, label=setting.label())
        ax.plot(x, [p.p50_ms for p in pts], "--", color=color, linewidth=0.8, alpha=0.7)
        for p in pts:
            face = color if p.sustained else "white"
            ax.plot(p.throughput, p.p99_ms, "o", color=color, markerfacecolor=face)
    ax.axhline(slo_p99_ms, color="red", linestyle=":", label=f"SLO p99 {number(slo_p99_ms)} ms")
    if chosen is not None:
        ax.plot(
            chosen.throughput, chosen.p99_ms, "*", color="black", markersize=16,
            label=f"chosen: {chosen.setting.label()}", zorder=5,
        )  # fmt: skip
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # 20, 50, 100: not 2x10^1
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("answered requests/s")
    ax.set_ylabel("end-to-end latency, ms (p99 solid, p50 dashed)")
    ax.set_title("infer-worker bench --sweep (open markers: rate not sustained)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def sweep_summary(
    opts: SweepOptions,
    points: Sequence[SweepPoint],
    skipped: Sequence[Skipped],
    chosen: SweepPoint | None,
    meets_slo: bool,
    wall: float,
) -> dict[str, Any]:
    rec: dict[str, Any] | None = None
    if chosen is not None:
        toml, env = config_lines(chosen.setting)
        rec = {
            **asdict(chosen.setting),
            "rate": chosen.rate,
            "meets_slo": meets_slo,
            "toml": "\n".join(toml),
            "env": env,
        }
    return {
        "grid": {
            "batch_sizes": opts.batch_sizes,
            "delays_ms": opts.delays,
            "rates": opts.rates,
            "duration_s": opts.duration,
            "partitions": opts.partitions,
            "overrides": opts.overrides,
        },
        "slo_p99_ms": opts.slo_p99_ms,
        "sustained_fraction": SUSTAINED_FRACTION,
        "points": [p.to_json() for p in points],
        "skipped": [asdict(s) for s in skipped],
        "recommendation": rec,
        "wall_seconds": wall,
    }


def _write_outputs(
    opts: SweepOptions, summary: dict[str, Any], points: Sequence[SweepPoint], chosen: Any
) -> None:
    json_out = opts.json_out
    if opts.plot:
        try:
            write_plot(points, chosen, opts.slo_p99_ms, opts.plot)
        except ImportError:
            json_out = json_out or str(Path(opts.plot).with_suffix(".json"))
            print(
                f"plot: not drawn, matplotlib is not installed; `pip install matplotlib` "
                f"(or the project's bench extra) draws {opts.plot} (the points are in "
                f"{json_out})"
            )
        else:
            print(f"plot: {opts.plot}")
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
        print(f"points: {json_out}")


async def _run(opts: SweepOptions) -> int:
    settings = check_options(opts)
    grid = opts.settings()
    print(
        f"infer-worker bench --sweep: {len(grid)} settings x {len(opts.rates)} rates, "
        f"{number(opts.duration)} s of open-loop Poisson arrivals each; model "
        f"{settings.model.path} on {settings.model.backend}, embedded broker, "
        f"{opts.partitions} partitions, one worker process; SLO p99 <= "
        f"{number(opts.slo_p99_ms)} ms",
        flush=True,
    )
    print(_HEADER, flush=True)
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
        print(
            f"  {s.max_batch_size:>5} {number(s.max_queue_delay_ms):>8} {s.rate:>7,.0f}  "
            f"skipped: {s.reason}"
        )
    lines, chosen, meets = recommendation_text(points, opts.slo_p99_ms)
    print("\n".join(lines))
    summary = sweep_summary(opts, points, skipped, chosen, meets, wall)
    _write_outputs(opts, summary, points, chosen)
    print(f"sweep: {wall:.0f} s")
    return 0 if meets else 1


def run_sweep(opts: SweepOptions) -> int:
    """0: a setting meets the SLO (printed with its config lines); 1: none does
    (the closest is printed); configuration errors raise ConfigError."""
    with children_die_with_this_process("bench --sweep"):
        return asyncio.run(_run(opts))
