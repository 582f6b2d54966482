"""Peers: what a Python team would pick instead of the worker, each written as
its users would, on the worker's model, payloads and wire contract. Each is a
module started as ``python -m benchmarks.peers.NAME`` with the worker's
``INFER_WORKER_*`` environment. Benchmark code, not shipped."""

from __future__ import annotations

import sys

NAMES = ("tight_loop", "faust_take", "quix_apply", "librdkafka_loop")

# The worker run from another copy of its package: ``python -m`` puts the working
# directory first on sys.path, so the other version is put in front explicitly.
_RUN_FROM = (
    "import sys; sys.path.insert(0, {!r}); "
    "from worker.__main__ import main; sys.exit(main(['run']))"
)

# Faust apps are started through their own command line.
_ARGS = {"faust_take": ("worker", "--loglevel", "warn")}


def argv(name: str) -> list[str]:
    """The command that starts peer ``name`` (run from the repository root)."""
    if name not in NAMES:
        raise ValueError(f"unknown peer {name!r} (known: {', '.join(NAMES)})")
    return [sys.executable, "-m", f"benchmarks.peers.{name}", *_ARGS.get(name, ())]


def package_argv(package_dir: str) -> list[str]:
    """The command that starts the worker package found in ``package_dir`` (a
    ``git worktree`` of another commit: the bench's ``--baseline-path``)."""
    return [sys.executable, "-c", _RUN_FROM.format(package_dir)]
