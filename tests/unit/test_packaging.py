"""The wheel the Dockerfile builds, from exactly the files the Dockerfile copies,
carries the kernels, the bundled model and the typed marker, and no test harness."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_from_docker_build_context_has_kernels_and_model(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            for src in parts[1:-1]:
                path = ROOT / src
                if path.is_dir():
                    shutil.copytree(
                        path, context / src, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    (context / src).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, context / src)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "-w",
            str(tmp_path / "w"),
            str(context),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "w").glob("infer_worker-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for cu in (ROOT / "kernels").glob("*.cu"):
        assert f"worker/_kernels/{cu.name}" in names
    assert {
        "worker/model/bundled/digits.onnx",
        "worker/model/bundled/digits_samples.npz",
        "worker/model/bundled/digits.json",
        "worker/py.typed",
        "worker/compute/engines/tensorrt.py",
    } <= names
    # Every module of the source tree ships (a subpackage missing from
    # pyproject's package list would import in a checkout and fail installed),
    # and nothing but the package does: benchmark and test code stay out.
    source = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "worker").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert source <= names, sorted(source - names)
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/", "devkit/"))]
    # No test harness in it: nothing that fetches Apache Kafka's jars or starts a
    # broker from them (devkit/ holds that, outside the wheel).
    with zipfile.ZipFile(wheel) as whl:
        harness = [
            n for n in names if n.endswith(".py")
            and any(mark in whl.read(n) for mark in (b"StorageTool", b"copy-dependencies"))
        ]  # fmt: skip
    assert not harness, harness
