"""scripts/gpu_session.sh fits each phase in one 10-minute device call with room
to spare (issue 22), checked here without a GPU: the script's own budget check,
a budget for every step it runs, the end-to-end GPU test's own timeout inside
its step's budget, and one compile cache shared by every process of a call."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def _budgets() -> dict[str, int]:
    block = re.search(r"declare -A BUDGET=\((.*?)\n\)", SCRIPT.read_text(), re.S)
    assert block is not None
    return {k: int(v) for k, v in re.findall(r"\[([\w.]+)\]=(\d+)", block.group(1))}


def test_every_phase_fits_its_call_with_a_minute_to_spare() -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "budgets"], capture_output=True, text=True, check=False, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    totals = dict(re.findall(r"^(\w+): (\d+) s of 600", proc.stdout, re.M))
    assert set(totals) == {"tests", "bench1", "bench2", "profile"}
    budgets = _budgets()
    for phase, total in totals.items():
        steps = [v for k, v in budgets.items() if k.startswith(("setup.", f"{phase}."))]
        assert int(total) == sum(steps) + 5 * len(steps) <= 540, phase  # 5 s kill grace each


def test_a_budget_over_the_call_stops_the_script_before_anything_runs(tmp_path: Path) -> None:
    over = SCRIPT.read_text().replace("[tests.e2e]=240", "[tests.e2e]=330")
    script = tmp_path / "gpu_session.sh"
    script.write_text(over)
    proc = subprocess.run(
        ["bash", str(script), "tests"], capture_output=True, text=True, check=False,
        timeout=30, cwd=tmp_path, env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 2 and "does not fit" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_every_step_has_a_budget() -> None:
    text = SCRIPT.read_text()
    used = set(re.findall(r"^\s*(?:step|bench) ([a-z0-9]+\.[a-z0-9]+) ", text, re.M))
    assert used and used <= set(_budgets()), used - set(_budgets())
    assert {"tests.suite", "tests.e2e", "bench1.jpeg1", "bench2.jpeg4"} <= used


def test_the_end_to_end_gpu_test_times_out_inside_its_step() -> None:
    test = (ROOT / "tests" / "gpu" / "test_gpu_modelbench.py").read_text()
    found = re.search(r"^E2E_TIMEOUT_S = (\d+)$", test, re.M)
    assert found is not None
    # pytest's start (torch imported, collection) fits in what is left.
    assert int(found.group(1)) + 30 <= _budgets()["tests.e2e"]


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
    assert text.index("export TORCHINDUCTOR_CACHE_DIR=") < text.index("step tests.suite")
