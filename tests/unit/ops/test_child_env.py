"""A child's environment extends PYTHONPATH and never replaces it (issue 22): the
GPU machine's missing packages are installed into a directory that only
PYTHONPATH names (scripts/gpu_session.sh), so a child given a PYTHONPATH of its
own fails there at its first import. Checked on the helper every child
environment goes through, and on every place in the repository that names
PYTHONPATH for a child."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from worker.ops.processes import extended_pythonpath, worker_env

ROOT = Path(__file__).resolve().parents[3]
SEP = os.pathsep


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return worker_env(
        "127.0.0.1:1", input_topics=["in"], output_topic="out", dlq_topic="dlq",
        group_id="g", metrics_port=1, extra=extra,
    )  # fmt: skip


def test_a_worker_keeps_the_inherited_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", f"/tmp/site{SEP}/repo")
    assert _env()["PYTHONPATH"] == f"/tmp/site{SEP}/repo"
    # A test's own entry goes in front; nothing inherited is dropped.
    assert _env({"PYTHONPATH": "/hooks"})["PYTHONPATH"] == f"/hooks{SEP}/tmp/site{SEP}/repo"
    both = _env({"PYTHONPATH": f"/hooks{SEP}/repo"})["PYTHONPATH"]
    assert both == f"/hooks{SEP}/repo{SEP}/tmp/site"


def test_without_an_inherited_pythonpath_only_the_given_entries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert "PYTHONPATH" not in _env()
    # No empty entry (which would put the working directory on sys.path).
    assert _env({"PYTHONPATH": "/hooks"})["PYTHONPATH"] == "/hooks"
    assert extended_pythonpath(Path("/a"), "/b", base="") == f"/a{SEP}/b"


def test_extended_pythonpath_puts_entries_first_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", f"/site{SEP}{SEP}/repo")
    assert extended_pythonpath("/repo") == f"/repo{SEP}/site"
    assert extended_pythonpath("/x", base=f"/y{SEP}/x") == f"/x{SEP}/y"


# A child's PYTHONPATH set in Python: a dict entry or an assignment.
_PY_SET = re.compile(r"""["']PYTHONPATH["']\s*(?:\]\s*=|:)\s*(?P<value>[^\n]*)""")
# ... and in a shell script: an assignment.
_SH_SET = re.compile(r"\bPYTHONPATH=(?P<value>\S*)")


def _sources() -> list[Path]:
    tops = ("tests", "bench", "scripts", "worker")
    files = [p for top in tops for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh")]
    return [p for p in files if p.is_file() and "__pycache__" not in p.parts]


def test_every_child_pythonpath_in_the_repository_extends_the_inherited_one() -> None:
    helper = ROOT / "worker" / "tools" / "processes.py"
    this = Path(__file__).resolve()
    bad = []
    for path in _sources():
        if path in (helper, this):
            continue
        text = path.read_text()
        pattern = _SH_SET if path.suffix == ".sh" else _PY_SET
        for m in pattern.finditer(text):
            value = m.group("value")
            extends = (
                "$PYTHONPATH" in value or "${PYTHONPATH" in value
                if path.suffix == ".sh"
                else value.startswith("extended_pythonpath(")
            )
            if not extends:
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0).strip()}")
    assert not bad, "PYTHONPATH replaced, not extended:\n" + "\n".join(bad)


def test_the_guard_sees_a_replacement() -> None:
    """The scan above would catch the line issue 22 found."""
    line = 'env={**os.environ, "PYTHONPATH": str(ROOT)},'
    m = _PY_SET.search(line)
    assert m is not None and not m.group("value").startswith("extended_pythonpath(")
    sh = _SH_SET.search("    export PYTHONPATH=/tmp/site:$PWD")
    assert sh is not None and "PYTHONPATH" not in sh.group("value")


def test_the_compile_cache_reaches_every_worker_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/gpu_session.sh names one torch compile cache per call; the bench's
    worker (``worker_env``) and each member of ``run --procs N`` (the
    supervisor's ``child_env``) must inherit it to share compiled graphs."""
    from worker.app.supervisor import child_env, members
    from worker.config import load_settings

    cache = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/cc", "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    for key, value in cache.items():
        monkeypatch.setenv(key, value)
    bench_worker = _env()
    member = child_env(bench_worker, members(load_settings(env={}), 2)[1])
    for key, value in cache.items():
        assert bench_worker[key] == value and member[key] == value
