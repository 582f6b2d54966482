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


def test_a_sweep_of_a_pipeline_measures_it_end_to_end(tmp_path: Path) -> None:
    """``--pipeline``: the pipeline answers the sweep's requests (its function
    refuses the digits the model is sure of: those answers are errors, which
    [model] alone would never give), every request answered."""
    out = tmp_path / "sweep.json"
    steps = ('[{name = "d", model = "digits"}, {name = "f", function = '
             '"tests.pipeline_functions:unsure_doubled", inputs = {x = "d.topk_scores"}, '
             'outputs = {y = "float32 [3]"}}]')  # fmt: skip
    proc = subprocess.run(
        [
            sys.executable, "-m", "worker", "bench", "--sweep", "--delays", "0",
            "--rates", "100", "--duration", "2", "--slo-p99-ms", "2000", "--plot", "",
            "--json", str(out), "--pipeline", "p", "--set", f"pipelines.p.steps={steps}",
            "--set", 'pipelines.p.outputs={scores = "f.y"}',
        ],
        capture_output=True, check=False, text=True, timeout=120,
    )  # fmt: skip
    assert "pipeline p (end to end)" in proc.stdout, proc.stdout + proc.stderr
    (point,) = json.loads(out.read_text())["points"]
    assert point["complete"] and 0 < point["errors"] < point["answered"] + point["errors"], point


def test_a_sweep_of_an_undefined_pipeline_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "bench", "--sweep", "--pipeline", "p", "--plot", ""],
        capture_output=True, check=False, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--pipeline 'p': no [pipelines.p]" in proc.stderr, proc.stderr
