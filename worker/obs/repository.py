"""The Open Inference Protocol's model repository extension on the metrics port
(``POST /v2/repository/index``, ``/v2/repository/models/NAME/load`` and
``/unload``: what Triton answers), for the worker's model repository and its
control topic (``worker.app.control``, which registers the handler here: this
layer knows neither Kafka nor engines).

A load writes the model's desired version to the control topic, which every
member of the group reads and applies: one call reaches them all, where an HTTP
call to one Triton server reaches that server. It answers once the record is
acknowledged, not once the version serves (``/v2/repository/index`` says which
version serves, per member). ``parameters.version`` names the version (this
worker's extension of the body; without it, the latest the repository holds),
``parameters.settings`` keys over its model.toml (``worker.app.desired``).
An unload writes a tombstone for the model: every member frees it and answers
its requests ``unknown_model`` until a load names a version again.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Protocol

JSON = "application/json"


class RepositoryControl(Protocol):
    def index(self) -> list[dict[str, Any]]:
        """Every version of every repository model: name, version, state, reason."""

    def load(self, name: str, version: int | None, settings: object = None) -> str | None:
        """Set ``name``'s version (None: the latest held), with ``settings`` over
        its model.toml; why not, or None."""

    def unload(self, name: str) -> str | None:
        """Unload ``name`` on every member; why not, or None."""


_handler: list[RepositoryControl] = []
_lock = threading.Lock()


def register(handler: RepositoryControl | None) -> None:
    """Answer the extension with ``handler`` (None: not served)."""
    with _lock:
        _handler[:] = [] if handler is None else [handler]


def answer(path: str, body: bytes) -> tuple[int, bytes]:
    """The status and JSON body for a ``POST /v2/repository/...``."""
    with _lock:
        handler = _handler[0] if _handler else None
    if handler is None:
        return 400, _json({"error": "the model repository extension needs [repository] and "
                                    "kafka.control_topic (docs/guides/models.md)"})  # fmt: skip
    parts = [p for p in path.split("/") if p][2:]  # after "v2/repository"
    if parts == ["index"]:
        return 200, _json(handler.index())
    if len(parts) != 3 or parts[0] != "models" or parts[2] not in ("load", "unload"):
        return 404, _json({"error": f"not found: {path}"})
    name, action = parts[1], parts[2]
    if action == "unload":
        problem = handler.unload(name)
        return (400, _json({"error": problem})) if problem is not None else (200, b"")
    try:
        request = json.loads(body) if body.strip() else {}
        parameters = request.get("parameters") or {}
        version, settings = parameters.get("version"), parameters.get("settings")
    except (ValueError, AttributeError):
        return 400, _json({"error": 'the body: expected JSON {"parameters": {"version": N}}'})
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        return 400, _json({"error": f"parameters.version: expected a version number, got "
                                    f"{str(version)[:32]!r}"})  # fmt: skip
    problem = handler.load(name, version, settings)
    if problem is not None:
        return 400, _json({"error": problem})
    return 200, b""


def _json(body: object) -> bytes:
    return json.dumps(body).encode()
