"""The models the worker serves, on the metrics port as the Open Inference
Protocol's HTTP endpoints show them (KServe v2; what Triton, KServe and MLServer
answer), so the tools that probe those servers can probe the worker:

* ``/v2/models/NAME`` (and ``/versions/VERSION``): the model's metadata (name,
  versions, platform, inputs and outputs as the model file declares them);
* ``/v2/models/NAME/ready``: 200 while the worker is ready and serves it;
* ``/v2/models``: every model served, with its version and readiness (not in
  the protocol, which lists models with a repository extension this is not);
* ``/v2``, ``/v2/health/live``, ``/v2/health/ready``: the server's metadata,
  liveness and readiness.

A model is ready when the worker is (``/readyz``): every model loads and passes
its start-up probe before the worker joins the group, and a model whose stage
fails stops the worker. A name or version not served is 404 with the OIP error
body naming what is. The cards are published by ``worker.app`` (plain data: this
layer knows no engines); a model swapped while serving publishes its new version.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from worker import __version__
from worker.obs import metrics

_cards: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()

JSON = "application/json"


def publish(name: str, card: Mapping[str, Any]) -> None:
    """Show ``card`` (the OIP model metadata: name, versions, platform, inputs,
    outputs) for the model ``name``, replacing what was shown."""
    with _lock:
        _cards[name] = dict(card)


def withdraw_all() -> None:
    """Show no model (a worker stopped; tests start several in one process)."""
    with _lock:
        _cards.clear()


def answer(path: str) -> tuple[int, bytes]:
    """The status and JSON body for a ``/v2`` path."""
    parts = [p for p in path.split("/") if p][1:]  # after "v2"
    with _lock:
        cards = {name: dict(card) for name, card in _cards.items()}
    ready = metrics.is_ready()
    if not parts:
        return 200, _json({"name": "infer-worker", "version": __version__, "extensions": []})
    if parts == ["health", "live"]:
        return (200 if metrics.loop_stale() is None else 503), b""
    if parts == ["health", "ready"]:
        return (200 if ready else 503), b""
    if parts == ["models"]:
        listed = [{"name": n, "version": c["versions"][0], "state": _state(ready)}
                  for n, c in cards.items()]  # fmt: skip
        return 200, _json({"models": listed})
    if parts[0] != "models" or len(parts) < 2:
        return 404, _json({"error": f"not found: {path}"})
    card = cards.get(parts[1])
    if card is None:
        return 404, _json({"error": f"model {parts[1][:64]!r} is not served here; this worker "
                                    f"serves {', '.join(repr(n) for n in cards)}"})  # fmt: skip
    rest = parts[2:]
    if rest[:1] == ["versions"] and len(rest) >= 2:
        if rest[1] not in card["versions"]:
            return 404, _json({"error": f"model {parts[1]!r} version {rest[1][:64]!r} is not "
                                        f"served; it serves {card['versions'][0]!r}"})  # fmt: skip
        rest = rest[2:]
    if not rest:
        return 200, _json(card)
    if rest == ["ready"]:
        return (200 if ready else 503), b""
    return 404, _json({"error": f"not found: {path}"})


def _state(ready: bool) -> str:
    return "READY" if ready else "UNAVAILABLE"


def _json(body: object) -> bytes:
    return json.dumps(body).encode()
