"""``bench --sweep``'s outputs: a line per point as it is measured, the curves
(p99 and p50 latency against throughput, one line per setting) as a PNG when
matplotlib is installed, and every point as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from worker.bench.openloop import SUSTAINED_FRACTION, SweepPoint, number
from worker.bench.options import SweepOptions
from worker.bench.recommend import by_setting, config_lines


@dataclass
class Skipped:
    """A rate not measured for a setting, and why."""

    max_batch_size: int
    max_queue_delay_ms: float
    rate: float
    reason: str


HEADER = (
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


def skipped_line(s: Skipped) -> str:
    return (
        f"  {s.max_batch_size:>5} {number(s.max_queue_delay_ms):>8} {s.rate:>7,.0f}  "
        f"skipped: {s.reason}"
    )


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
    groups = by_setting(points)
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


def write_outputs(
    opts: SweepOptions,
    summary: dict[str, Any],
    points: Sequence[SweepPoint],
    chosen: SweepPoint | None,
) -> None:
    """The plot (or, without matplotlib, the JSON beside where it would be) and
    the JSON."""
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
