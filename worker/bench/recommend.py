"""The sweep's recommendation: a pure function of the points (``best_setting``),
so the rule is tested on hand-made points, and the lines it prints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from worker.bench.openloop import SUSTAINED_FRACTION, Setting, SweepPoint, number
from worker.ops.processes import override_env


def by_setting(points: Iterable[SweepPoint]) -> dict[Setting, list[SweepPoint]]:
    """Points grouped by setting, each group by rising rate."""
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
    for pts in by_setting(points).values():
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


def config_lines(setting: Setting) -> tuple[list[str], list[str]]:
    """The TOML lines and the equivalent environment variables."""
    toml = [
        "[batching]",
        f"max_batch_size = {setting.max_batch_size}",
        f"max_queue_delay_ms = {number(setting.max_queue_delay_ms)}",
    ]
    return toml, [f"{k}={v}" for k, v in override_env(setting.overrides()).items()]


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
