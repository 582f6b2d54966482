"""The pinned versions every install of this repository resolves to (constraints.txt).

``make test``, ``make demo``, scripts/ci_tools.sh and the Dockerfile install with
``--constraint constraints.txt``: a new release of a dependency cannot change what
CI, a developer or an image runs until someone updates this file on purpose
(a release of onnxruntime's quantizer, or a CPU without VNNI, turned main red
before: the lock makes the first kind of change a commit of its own).

    python scripts/lock.py             # resolve the newest allowed versions, write constraints.txt
    python scripts/lock.py --check     # exit 1 if constraints.txt misses or breaks a requirement
    python scripts/lock.py --diff VENV # what VENV has installed that constraints.txt pins otherwise

``make lock`` runs the first and prints what moved; ``make newest`` installs the
newest allowed versions into .venv-newest without the constraints, prints
``--diff`` of it and runs the whole test suite there, so what a new release would
break is known before the lock moves. The resolution is pip's own
(``pip install --dry-run --ignore-installed --report``) for every extra a test, a
benchmark or an image installs, on the interpreter that runs this script: CI's is
CPython 3.11 on Linux x86-64. The images run 3.12: a lock is written only when the
Dockerfile's requirements also resolve within it to wheels for 3.12 (``check_images``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
# Every extra something in this repository installs. Not `tensorrt` (PyPI serves a
# stub that downloads from NVIDIA's index) nor `minilm` (a one-off export script's).
EXTRAS = (
    "embedded", "dev", "torch", "quantize", "gpu", "bench", "tracing", "plot", "train", "registry",
)
HEADER = """\
# Pinned by scripts/lock.py (`make lock`): pyproject.toml's requirements with the
# extras {extras},
# resolved by pip on Python {python} ({platform}).
# Every install of this repository uses it (Makefile, scripts/ci_tools.sh, Dockerfile):
# change it on purpose, after `make newest` has run the tests on what would move.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve() -> dict[str, str]:
    """name -> version of everything pip installs for the project with EXTRAS."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--disable-pip-version-check", "--report", str(report),
               f"{ROOT}[{','.join(EXTRAS)}]"]  # fmt: skip
        subprocess.run(cmd, check=True)
        installed = json.loads(report.read_text())["install"]
    pins = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installed}
    pins.pop("infer-worker", None)
    return dict(sorted(pins.items()))


def check_images(pins: dict[str, str]) -> None:
    """The images' requirements (the Dockerfile: the core, [gpu,torch,registry] and onnx) resolve
    within ``pins`` to wheels for their Python 3.12 on Linux x86-64; raises if not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [*project["dependencies"], *extras["gpu"], *extras["torch"], *extras["registry"], "onnx"]
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(5, 40)]
    tags += ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"]
    with tempfile.TemporaryDirectory() as tmp:
        pinned = Path(tmp) / "constraints.txt"
        pinned.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
               "--python-version", "3.12", "--target", str(Path(tmp) / "t"),
               "--constraint", str(pinned), *(f"--platform={t}" for t in tags), *reqs]  # fmt: skip
        subprocess.run(cmd, check=True)


def read(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def write(pins: dict[str, str], path: Path = CONSTRAINTS) -> None:
    header = HEADER.format(
        extras=", ".join(EXTRAS), python=".".join(map(str, sys.version_info[:2])),
        platform=sys.platform,
    )  # fmt: skip
    path.write_text(header + "".join(f"{n}=={v}\n" for n, v in pins.items()))


def requirements() -> list[str]:
    """pyproject.toml's requirements: the core ones and those of EXTRAS."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return reqs


def problems(pins: dict[str, str]) -> list[str]:
    """Each requirement of this platform that the pins leave open or contradict."""
    from packaging.requirements import Requirement

    found = []
    for text in requirements():
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        pinned = pins.get(canonical(req.name))
        if pinned is None:
            found.append(f"{req.name}: not pinned (run `make lock`)")
        elif not req.specifier.contains(pinned, prereleases=True):
            found.append(f"{req.name}=={pinned} does not satisfy '{text}' (run `make lock`)")
    return found


def diff(old: dict[str, str], new: dict[str, str]) -> list[str]:
    lines = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a != b:
            lines.append(f"{name}: {a or '(none)'} -> {b or '(none)'}")
    return lines


def installed(venv: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json",
         "--disable-pip-version-check", "--exclude", "infer-worker"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return {canonical(p["name"]): p["version"] for p in json.loads(out)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="check constraints.txt only")
    group.add_argument("--diff", type=Path, metavar="VENV",
                       help="VENV's installed versions against constraints.txt")  # fmt: skip
    args = parser.parse_args()
    if args.check:
        found = problems(read())
        print("\n".join(found) or "constraints.txt: every requirement pinned and satisfied")
        return 1 if found else 0
    if args.diff is not None:
        locked = read()
        have = installed(args.diff)
        have.pop("pip", None)
        moved = [line for line in diff(locked, have) if "-> (none)" not in line]
        print("\n".join(moved) or f"{args.diff}: every package at its pinned version")
        return 0
    old = read() if CONSTRAINTS.exists() else {}
    new = resolve()
    check_images(new)
    write(new)
    print("\n".join(diff(old, new)) or "constraints.txt: nothing moved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
