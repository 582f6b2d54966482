"""A tool stopped by a signal leaves nothing running (issue 22): every process
it started, the embedded broker (``tansu``), the worker and, under ``run
--procs N``, the supervisor's members (in sessions of their own), is gone by the
time the tool has exited, so nothing runs on into the next measurement.

Each tool is started in a session of its own, watched through ``/proc`` (its
whole tree, read here independently of ``worker.ops.children``) until its
worker processes run, then signalled: SIGTERM and SIGINT to the tool alone, and
``timeout``'s own SIGTERM. ``timeout`` is made to fire on demand by sending it a
SIGTERM, which it passes on exactly as on expiry (to the command, then to the
command's process group), so the test does not depend on how fast this machine
reaches the drain. Every process seen in the tree must be dead (gone, or a
zombie: exited, waiting to be reaped) as soon as the tool's exit is observed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)"),
]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _tree(root: int) -> dict[int, str]:
    """Every process under ``root`` now: pid -> command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[1], []).append(int(entry))
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(pid)
    return out


def _running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _stop_and_check(
    argv: list[str], workers: int, signum: int, tmp_path: Path, *, via_timeout: bool = False
) -> None:
    """Run ``argv``; once its tree holds the broker and ``workers`` worker
    processes (and they had a second to get going), send ``signum`` (to
    ``timeout`` when ``via_timeout``); then nothing seen in the tree may run."""
    if via_timeout:
        argv = [shutil.which("timeout") or "timeout", "-s", "TERM", "600", *argv]
    err = tmp_path / "stderr.txt"
    with err.open("w") as errors:
        tool = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=errors, start_new_session=True,
        )  # fmt: skip
    seen: dict[int, str] = {}
    try:
        deadline, ready_at = time.monotonic() + 120, None
        while time.monotonic() < deadline and tool.poll() is None:
            now = _tree(tool.pid)
            seen |= now
            running = [c for c in now.values() if "-m worker run" in c]
            brokers = [c for c in now.values() if "tansu" in c]
            if ready_at is None and len(running) >= workers and brokers:
                ready_at = time.monotonic()
            if ready_at is not None and time.monotonic() - ready_at >= 1.0:
                break
            time.sleep(0.05)
        assert tool.poll() is None, f"the tool ended before it was stopped:\n{err.read_text()}"
        assert ready_at is not None, f"no {workers} workers and broker in 120 s: {seen}"
        seen |= _tree(tool.pid)
        tool.send_signal(signum)
        status = tool.wait(60)
    finally:
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)
        left = [pid for pid in seen if _running(pid)]
        for pid in left:  # never leave them to the next test either
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the tool exited: {[seen[p] for p in left]}"
    assert status == 128 + (signal.SIGTERM if via_timeout else signum), err.read_text()
    assert "child process(es) killed" in err.read_text()
    assert sum("-m worker run" in c for c in seen.values()) >= workers  # what was stopped
    assert any("tansu" in c for c in seen.values())


MODEL_BENCH = [
    PY, "-m", "worker", "bench", "--model", "digits", "--payload", "raw", "--procs", "2",
    "--records", "2000", "--rate", "50", "--duration", "60",
]  # fmt: skip


@pytest.mark.parametrize(
    ("signum", "via_timeout"),
    [(signal.SIGTERM, True), (signal.SIGTERM, False), (signal.SIGINT, False)],
    ids=["timeout", "sigterm", "sigint"],
)
def test_bench_model_with_two_processes(signum: int, via_timeout: bool, tmp_path: Path) -> None:
    """The supervisor and both members (own sessions), and the broker."""
    argv = [*MODEL_BENCH, "--results-dir", str(tmp_path / "results")]
    # The supervisor and its two members all run ``python -m worker run``.
    _stop_and_check(argv, 3, signum, tmp_path, via_timeout=via_timeout)


@pytest.mark.parametrize(
    "argv",
    [
        [PY, "-m", "worker", "demo", "--repeat", "10", "--rate", "50"],
        [PY, "-m", "worker", "bench", "--sweep", "--delays", "0", "--rates", "50",
         "--duration", "60", "--plot", ""],
        [PY, "-m", "benchmarks.drain", "--records", "100000", "--repeat", "1", "--peers"],
        [PY, "-m", "benchmarks.latency", "--rate", "50", "--records", "3000", "--peers"],
    ],
    ids=["demo", "sweep", "benchmarks.drain", "benchmarks.latency"],
)  # fmt: skip
def test_other_tools_on_sigterm(argv: list[str], tmp_path: Path) -> None:
    _stop_and_check(argv, 1, signal.SIGTERM, tmp_path)
