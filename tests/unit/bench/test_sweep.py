"""``bench --sweep``'s rule on hand-made points: which setting it recommends,
what it refuses, and the lines it prints. Running the grid is exercised in
tests/integration/test_sweep.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from worker.__main__ import build_parser, main
from worker.bench import sweep, sweep_report
from worker.bench.openloop import Setting, SweepPoint
from worker.bench.options import SweepOptions
from worker.bench.recommend import (
    best_setting,
    closest_setting,
    config_lines,
    recommendation_text,
)
from worker.bench.sweep import check_options
from worker.config import load_settings
from worker.flow.errors import ConfigError


def point(
    batch: int,
    delay: float,
    rate: float,
    p99: float,
    *,
    answered: int | None = None,
    throughput: float | None = None,
    errors: int = 0,
) -> SweepPoint:
    """A point that is sustained unless told otherwise: every request answered,
    answers/s equal to the rate offered."""
    sent = int(rate * 5)
    return SweepPoint(
        max_batch_size=batch,
        max_queue_delay_ms=delay,
        rate=rate,
        sent=sent,
        answered=sent if answered is None else answered,
        errors=errors,
        offered=rate,
        throughput=rate if throughput is None else throughput,
        p50_ms=p99 / 3,
        p95_ms=p99 * 0.9,
        p99_ms=p99,
        max_ms=p99 * 1.2,
    )


def test_highest_sustained_rate_within_the_slo_wins() -> None:
    points = [
        point(64, 0, 200, 5), point(64, 0, 1000, 8), point(64, 0, 3000, 80),
        point(64, 5, 200, 9), point(64, 5, 1000, 10), point(64, 5, 3000, 30),
    ]  # fmt: skip
    best = best_setting(points, slo_p99_ms=50)
    assert best is not None
    assert (best.setting, best.rate) == (Setting(64, 5.0), 3000)


def test_the_slo_boundary_is_inclusive() -> None:
    points = [point(64, 0, 1000, 50.0), point(64, 5, 1000, 50.001), point(64, 5, 200, 3)]
    best = best_setting(points, slo_p99_ms=50)
    assert best is not None and best.setting == Setting(64, 0.0)
    # Just below the p99 of the only 1000/s point within it: only 200/s qualifies.
    below = best_setting(points, slo_p99_ms=49.999)
    assert below is not None and (below.setting, below.rate) == (Setting(64, 5.0), 200)


def test_a_rate_not_kept_up_with_is_not_sustained_however_low_its_p99() -> None:
    slow = point(64, 0, 3000, 5, throughput=0.94 * 3000)  # answers fell behind arrivals
    kept = point(64, 0, 3000, 5, throughput=0.95 * 3000)
    assert not slow.sustained and kept.sustained
    points = [point(64, 0, 1000, 8), slow, point(64, 5, 1000, 20), point(64, 5, 3000, 40)]
    best = best_setting(points, slo_p99_ms=50)
    assert best is not None and (best.setting, best.rate) == (Setting(64, 5.0), 3000)


def test_a_rate_with_unanswered_or_failed_requests_is_not_sustained() -> None:
    lost = point(64, 0, 3000, 5, answered=14_999)
    failed = point(64, 2, 3000, 5, errors=1)
    incomplete = point(64, 3, 3000, 5)
    incomplete.complete = False
    assert not (lost.sustained or failed.sustained or incomplete.sustained)
    ok = point(64, 5, 3000, 45)
    best = best_setting([lost, failed, incomplete, ok], slo_p99_ms=50)
    assert best is ok


def test_ties_on_rate_go_to_the_lower_p99_not_the_noisier_throughput() -> None:
    """Both sustain 3000/s; 3,020 vs 2,990 answers/s is noise, 12 vs 30 ms is not."""
    a = point(64, 10, 3000, 30, throughput=3020)
    b = point(32, 2, 3000, 12, throughput=2990)
    assert best_setting([a, b], slo_p99_ms=50) is b
    assert best_setting([b, a], slo_p99_ms=50) is b


def test_a_setting_must_meet_the_slo_at_every_lower_rate_too() -> None:
    """A long delay meets the SLO when batches fill fast, and breaks it whenever
    traffic is lighter: not recommended at its higher rate."""
    points = [
        point(64, 10, 200, 70), point(64, 10, 1000, 20),  # breaks the SLO at 200/s
        point(64, 0, 200, 4), point(64, 0, 1000, 45),
    ]  # fmt: skip
    best = best_setting(points, slo_p99_ms=50)
    assert best is not None and best.setting == Setting(64, 0.0) and best.rate == 1000


def test_nothing_meets_the_slo_then_the_closest_is_named_and_the_exit_is_1() -> None:
    points = [point(64, 0, 200, 60), point(64, 5, 200, 55), point(64, 5, 1000, 90)]
    assert best_setting(points, slo_p99_ms=50) is None
    closest = closest_setting(points)
    assert closest is not None and (closest.setting, closest.rate) == (Setting(64, 5.0), 200)
    lines, chosen, meets = recommendation_text(points, slo_p99_ms=50)
    assert chosen is closest and not meets
    assert lines[0].startswith("NO setting meets p99 <= 50 ms")
    assert any("do NOT meet" in line for line in lines)


def test_closest_without_any_sustained_point_prefers_the_most_answered() -> None:
    a = point(64, 0, 3000, 20, answered=100)
    b = point(64, 5, 3000, 900, throughput=1000)  # all answered, but late
    assert closest_setting([a, b]) is b
    assert closest_setting([]) is None


def test_printed_lines_are_accepted_by_the_worker_config(tmp_path: Path) -> None:
    for delay in (0.0, 2.0, 2.5, 0.125):
        toml, env = config_lines(Setting(32, delay))
        cfg = tmp_path / "w.toml"
        cfg.write_text("\n".join(toml) + "\n")
        from_toml = load_settings(cfg, env={}).batching
        from_env = load_settings(env=dict(line.split("=", 1) for line in env)).batching
        assert from_toml == from_env
        assert (from_env.max_batch_size, from_env.max_queue_delay_ms) == (32, delay)
    assert config_lines(Setting(64, 2.0))[1] == [
        "INFER_WORKER_BATCHING__MAX_BATCH_SIZE=64",
        "INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS=2",
    ]


def test_a_grid_the_worker_would_refuse_is_refused_before_anything_starts() -> None:
    check_options(SweepOptions())  # the defaults are valid
    with pytest.raises(ConfigError, match=r"batching\.max_batch_size"):
        check_options(SweepOptions(batch_sizes=[-1]))
    with pytest.raises(ConfigError, match=r"batching\.max_queue_delay_ms"):
        check_options(SweepOptions(delays=[-1.0]))
    with pytest.raises(ConfigError, match="--rates"):
        check_options(SweepOptions(rates=[0.0]))
    with pytest.raises(ConfigError, match="swept by --sweep"):
        check_options(SweepOptions(overrides={"batching.max_queue_delay_ms": "3"}))


def test_command_line_reaches_the_sweep_with_its_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[SweepOptions] = []
    monkeypatch.setattr(sweep, "run_sweep", lambda opts: seen.append(opts) or 0)
    argv = ["bench", "--sweep", "--delays", "0,2.5", "--batch-sizes", "16,32", "--rates", "100"]
    assert main(argv) == 0
    assert seen[0].settings() == [Setting(b, d) for b in (16, 32) for d in (0.0, 2.5)]
    assert seen[0].rates == [100.0] and seen[0].plot == "sweep.png"
    assert main(["bench", "--sweep", "--rate", "300"]) == 2  # --rate is not swept
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--sweep", "--delays", "0,fast"])


def test_plot_is_drawn_and_without_matplotlib_the_points_still_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    points = [point(64, d, r, p) for d, r, p in ((0, 200, 4), (0, 1000, 9), (5, 200, 8))]
    points.append(point(64, 5, 1000, 400, throughput=700))
    chosen = best_setting(points, 50)
    png = tmp_path / "sweep.png"
    sweep_report.write_plot(points, chosen, 50, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    opts = SweepOptions(plot=str(tmp_path / "again.png"))
    summary = sweep_report.sweep_summary(opts, points, [], chosen, True, 1.0)
    sweep_report.write_outputs(opts, summary, points, chosen)
    out = capsys.readouterr().out
    assert "pip install matplotlib" in out and not (tmp_path / "again.png").exists()
    written = json.loads((tmp_path / "again.json").read_text())
    assert len(written["points"]) == 4 and written["recommendation"]["meets_slo"]


def test_a_worker_that_keeps_up_is_sustained_whatever_its_latency() -> None:
    """The answered rate is taken over the answers' own span: 200 requests sent
    evenly over 2 s and each answered 0.3 s later is 100/s answered, sustained
    (over first send to last answer it read 87/s, not sustained)."""
    from worker.bench.openloop import SweepPoint, _score
    from worker.contract import ModelInfo, Result, Source, encode_result
    from worker.ops.topics import Collected, Produced

    n, latency = 200, 0.3
    produced = [Produced(b"k%d" % i, b"", i * 2.0 / (n - 1), 0, i) for i in range(n)]
    value = encode_result(Result(id="r", status="ok", source=Source("t", 0, 0),
                                 model=ModelInfo("m", "v")))  # fmt: skip
    answers = [Collected(p.key, value, {}, 0, i, p.sent_at + latency)
               for i, p in enumerate(produced)]  # fmt: skip

    class Tally:
        def answers(self, collector: object, topic: str) -> list[Collected]:
            return answers if topic == "results" else []

    point = SweepPoint(64, 0.0, rate=100.0, sent=n)
    _score(point, Tally(), None, {"results": "results", "dlq": "dlq"}, produced)  # type: ignore[arg-type]
    assert point.offered == pytest.approx(100, rel=0.01)
    assert point.throughput == pytest.approx(point.offered) and point.sustained
    assert point.seconds == pytest.approx(2.0 + latency)
