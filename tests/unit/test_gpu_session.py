"""scripts/gpu_session.sh runs the whole GPU path in one device call of at most
7 minutes, leaving a session's 15 minutes room for a rerun (issue 40), checked
here without a GPU: the script's own budget check, a budget for every step it
runs, a rerun of named steps only, and one compile cache shared by every
process of a call."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"
KILL_GRACE_S = 5
NAMED_ONLY = ["profile.jpeg", "micro.place", "ab.jpeg", "scale.jpeg", "scale.raw", "scale.mps",
              "profile.procs", "scale.parts16", "models.gpu", "pipeline.gpu"]  # fmt: skip


def _budgets() -> dict[str, int]:
    block = re.search(r"declare -A BUDGET=\((.*?)\n\)", SCRIPT.read_text(), re.S)
    assert block is not None
    return {k: int(v) for k, v in re.findall(r"\[([\w.]+)\]=(\d+)", block.group(1))}


def _run(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, check=False,
        timeout=30, cwd=cwd, env={"OUT": str(cwd / "out"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_every_step_fits_one_seven_minute_call_with_room_to_spare() -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "budgets"], capture_output=True, text=True, check=False, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"^all: (\d+) s of (\d+) \(spare (\d+) s", proc.stdout, re.M)
    assert found is not None, proc.stdout
    total, call, spare = map(int, found.groups())
    budgets = {k: v for k, v in _budgets().items() if k not in NAMED_ONLY}
    assert total == sum(budgets.values()) + KILL_GRACE_S * len(budgets)
    assert call <= 7 * 60 and spare >= 20 and total + spare <= call


def test_a_budget_over_the_call_stops_the_script_before_anything_runs(tmp_path: Path) -> None:
    over = SCRIPT.read_text().replace("[bench.raw]=80", "[bench.raw]=200")
    assert over != SCRIPT.read_text()
    script = tmp_path / "gpu_session.sh"
    script.write_text(over)
    proc = _run(script, cwd=tmp_path)
    assert proc.returncode == 2 and "do not fit" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_unknown_step_stops_the_script_before_anything_runs(tmp_path: Path) -> None:
    proc = _run(SCRIPT, "bench.jpeg", "bench.png", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown step bench.png" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_every_step_has_a_budget_and_a_branch() -> None:
    text = SCRIPT.read_text()
    steps = re.search(r"^STEPS=\((.*)\)$", text, re.M)
    assert steps is not None
    names = steps.group(1).split()
    assert names == ["tests.gpu", "bench.jpeg", "bench.raw"]
    optional = re.search(r"^OPTIONAL=\((.*)\)$", text, re.M)
    assert optional is not None and optional.group(1).split() == NAMED_ONLY
    assert set(_budgets()) == {"setup.wheels", "setup.gpu", *names, *NAMED_ONLY}
    for name in [*names, *NAMED_ONLY]:  # each runs under step() with its own name
        assert re.search(rf"^\s*{re.escape(name)}\)", text, re.M), name
        assert re.search(rf"(step|bench) {re.escape(name)} ", text), name


def test_named_steps_over_one_call_stop_the_script_before_anything_runs(tmp_path: Path) -> None:
    """A rerun names its steps; together they must fit one call as well."""
    proc = _run(SCRIPT, "tests.gpu", "bench.jpeg", "bench.raw", "profile.jpeg", cwd=tmp_path)
    assert proc.returncode == 2 and "do not fit one call" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_deselected_end_to_end_test_exists() -> None:
    """A --deselect of a test that is gone is silently ignored: hold the name."""
    text = SCRIPT.read_text()
    found = re.search(r"--deselect (\S+)::(\w+)", text)
    assert found is not None
    path, name = found.groups()
    assert f"def {name}(" in (ROOT / path).read_text()


def test_one_compile_cache_for_every_process_of_a_call() -> None:
    text = SCRIPT.read_text()
    for line in (
        "export TORCHINDUCTOR_CACHE_DIR=",
        "export TORCHINDUCTOR_FX_GRAPH_CACHE=1",
        "export TORCHINDUCTOR_AUTOGRAD_CACHE=1",
        "export TRITON_CACHE_DIR=$TORCHINDUCTOR_CACHE_DIR/",
    ):
        assert line in text, line
    # Exported before the first step that starts Python processes.
    assert text.index("export TORCHINDUCTOR_CACHE_DIR=") < text.index("step tests.gpu")


def test_the_several_processes_call_and_its_rerun_each_fit_one_call() -> None:
    """Issue 55: --procs 1, 2, 4 on JPEGs and 4 on raw in one call; MPS and the
    profile of every process in the rerun."""
    b = _budgets()
    for steps in (("scale.jpeg", "scale.raw"), ("scale.mps", "profile.procs"),
                  ("scale.parts16",),  # issue 66: N readers, N senders, more partitions
                  ("models.gpu", "pipeline.gpu")):  # issue 66: several models, a pipeline
        total = sum(b[k] + KILL_GRACE_S for k in ("setup.wheels", "setup.gpu", *steps))
        assert total <= 7 * 60 - 20, (steps, total)


def test_scale_runs_one_benchmark_per_process_count(tmp_path: Path) -> None:
    """``scale`` (as the steps run it, in a bash -c of its own) starts the bench
    once per count with the arguments given, and stops at the first failure."""
    text = SCRIPT.read_text()
    body = re.search(r"^scale\(\) \{\n.*?^\}$", text, re.M | re.S)
    assert body is not None
    fake = tmp_path / "bench"
    fake.write_text('#!/bin/sh\necho "bench $*"\n[ "$3" != 3 ]\n')
    fake.chmod(0o755)
    script = f"SCALE=({fake} x)\n{body.group(0)}\nscale 1 2 4 -- --payload jpeg\n"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if line.startswith("bench ")]
    assert runs == [f"bench x --procs {p} --payload jpeg" for p in (1, 2, 4)]
    failing = script.replace("scale 1 2 4", "scale 1 3 4")
    proc = subprocess.run(["bash", "-c", failing], capture_output=True, text=True, timeout=30,
                          check=False)  # fmt: skip
    assert proc.returncode != 0 and "--procs 4" not in proc.stdout


def test_the_several_models_and_pipeline_steps_run_their_benchmarks_on_the_gpu() -> None:
    """Issue 66 items 3 and 4: each step runs its benchmark module with the torch
    backend (the twin is for this machine) into $OUT/results, and the header
    gives the call that runs both."""
    text = SCRIPT.read_text()
    for name, module in (("models.gpu", "benchmarks.gpu_models"),
                         ("pipeline.gpu", "benchmarks.gpu_pipeline")):  # fmt: skip
        branch = re.search(rf"^\s*{re.escape(name)}\)\n(.*?)^\s*;;", text, re.M | re.S)
        assert branch is not None, name
        body = branch.group(1)
        assert f"python3 -m {module} --backend torch" in body, body
        assert '--results-dir "$OUT/results"' in body, body
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file()
    assert 'run(command="bash scripts/gpu_session.sh models.gpu pipeline.gpu"' in text
