"""``bench --sweep`` end to end on a tiny grid: every grid point measured with
every request answered, and the printed recommendation is a configuration the
worker accepts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from worker.config import load_settings

pytestmark = pytest.mark.integration


def test_tiny_sweep_measures_every_point_and_prints_a_usable_setting(tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = subprocess.run(
        [
            sys.executable, "-m", "worker", "bench", "--sweep", "--delays", "0,5",
            "--rates", "100,200", "--duration", "2", "--slo-p99-ms", "2000",
            "--json", str(out), "--plot", str(png),
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    grid = {(p["max_queue_delay_ms"], p["rate"]) for p in summary["points"]}
    assert grid == {(0.0, 100.0), (0.0, 200.0), (5.0, 100.0), (5.0, 200.0)}
    assert summary["skipped"] == []
    for p in summary["points"]:
        assert p["max_batch_size"] == 64 and p["complete"]
        assert p["answered"] == p["sent"] == round(p["rate"] * 2) and p["errors"] == 0
        assert 0 < p["p50_ms"] <= p["p99_ms"] <= p["max_ms"] and p["mean_batch_size"] >= 1
    rec = summary["recommendation"]
    assert rec["meets_slo"] and rec["rate"] == 200.0  # every point is sustained at this SLO

    printed = proc.stdout.splitlines()
    env = dict(
        line.strip().split("=", 1)
        for line in printed
        if line.strip().startswith("INFER_WORKER_BATCHING__")
    )
    assert len(env) == 2, proc.stdout
    batching = load_settings(env=env).batching
    assert (batching.max_batch_size, batching.max_queue_delay_ms) == (
        rec["max_batch_size"],
        rec["max_queue_delay_ms"],
    )
    start = printed.index("  [batching]")
    toml = tomllib.loads("\n".join(line.strip() for line in printed[start : start + 3]))
    assert toml["batching"] == {
        "max_batch_size": rec["max_batch_size"],
        "max_queue_delay_ms": rec["max_queue_delay_ms"],
    }
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"
