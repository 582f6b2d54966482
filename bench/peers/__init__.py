"""Peers: what a Python team would pick instead of the worker, each written as
its users would, on the worker's model, payloads and wire contract. Each is a
module started as ``python -m bench.peers.NAME`` with the worker's
``INFER_WORKER_*`` environment. Benchmark code, not shipped."""

from __future__ import annotations

import sys

NAMES = ("tight_loop", "faust_take", "quix_apply", "librdkafka_loop")

# Faust apps are started through their own command line.
_ARGS = {"faust_take": ("worker", "--loglevel", "warn")}


def argv(name: str) -> list[str]:
    """The command that starts peer ``name`` (run from the repository root)."""
    if name not in NAMES:
        raise ValueError(f"unknown peer {name!r} (known: {', '.join(NAMES)})")
    return [sys.executable, "-m", f"bench.peers.{name}", *_ARGS.get(name, ())]
