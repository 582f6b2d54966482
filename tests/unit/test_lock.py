"""constraints.txt (scripts/lock.py): every requirement pinned within what
pyproject.toml allows, and every install of the repository held to it, so a
dependency's new release cannot change what CI or an image runs."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _lock() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lock"] = module
    spec.loader.exec_module(module)
    return module


lock = _lock()


def test_every_requirement_is_pinned_within_its_range() -> None:
    pins = lock.read()
    assert lock.problems(pins) == []
    # Names are compared canonically (PyYAML is pyyaml, ml_dtypes is ml-dtypes).
    assert pins["pyyaml"] and pins["ml-dtypes"] and pins["onnxruntime"]


def test_a_missing_or_contradicting_pin_is_named() -> None:
    pins = lock.read()
    del pins["msgspec"]
    pins["numpy"] = "1.0.0"
    found = lock.problems(pins)
    assert any(p.startswith("msgspec: not pinned") for p in found), found
    assert any(p.startswith("numpy==1.0.0 does not satisfy 'numpy>=1.26'") for p in found)


def test_the_lock_round_trips_and_diffs_by_package(tmp_path: Path) -> None:
    pins = {"a-b": "1.0", "c": "2.0"}
    path = tmp_path / "constraints.txt"
    lock.write(pins, path)
    assert path.read_text().startswith("# Pinned by scripts/lock.py")
    assert lock.read(path) == pins
    assert lock.diff(pins, {"a-b": "1.1", "d": "3"}) == [
        "a-b: 1.0 -> 1.1", "c: 2.0 -> (none)", "d: (none) -> 3",
    ]  # fmt: skip


def test_every_install_is_held_to_the_pins() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PIP\s*:=.*\\\n.*--constraint \$\(CONSTRAINTS\)", makefile, re.M)
    assert re.search(r"^CONSTRAINTS \?= constraints\.txt$", makefile, re.M)
    ci_tools = (ROOT / "scripts" / "ci_tools.sh").read_text()
    torch_installs = [line for line in ci_tools.splitlines() if "pip install" in line]
    assert torch_installs and all('"${pins[@]}"' in line for line in torch_installs)
    # Every pip command of the Dockerfile (continuation lines joined) names the pins.
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    pip_runs = [line for line in dockerfile.splitlines() if re.search(r"pip (install|wheel)", line)]
    assert len(pip_runs) >= 3
    for line in pip_runs:
        for command in re.findall(r"pip (?:install|wheel)[^&]*", line):
            assert "--constraint" in command, line
