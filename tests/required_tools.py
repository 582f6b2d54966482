"""Outside tools some tests run for real (promtool, Prometheus, kubernetes-validate,
torch and torchvision for the torch engine on the CPU).

On a developer's machine a missing tool skips the test, with the command that
installs it in the reason. Under ``CI=true`` it fails instead: CI installs the
tools (``scripts/ci_tools.sh``, run by ``make test``), so a missing one there is
a broken setup, and a skip would let the checks silently stop running.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

# Debian and Ubuntu package Prometheus with promtool; elsewhere the release
# tarball has both binaries.
PROMETHEUS_INSTALL = (
    "apt-get install prometheus (Debian/Ubuntu), or put prometheus and promtool on PATH"
)
DEV_INSTALL = "pip install -e '.[dev]' (or make .venv/.installed-test)"
# PyPI's torch is a CUDA build that runs on the CPU (about 5.4 GB with torchvision).
TORCH_INSTALL = "pip install -e '.[torch]'"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def missing(what: str, install: str) -> NoReturn:
    """Skip (a developer's machine) or fail (CI) for a tool that is not here."""
    reason = f"{what} is not installed: {install}"
    if in_ci():
        pytest.fail(f"{reason} (CI=true: make test installs it in CI, so a skip would hide a gap)")
    pytest.skip(reason)


def binary(name: str, install: str = PROMETHEUS_INSTALL) -> str:
    """The path of executable ``name`` on PATH."""
    path = shutil.which(name)
    if path is None:
        missing(name, install)
    return path


def module(name: str, install: str = DEV_INSTALL) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"the Python module {name}", install)
