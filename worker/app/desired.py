"""A control record's value (``kafka.control_topic``, issue 68): a repository
model's desired state, as JSON any Kafka tool can write.

``{"version": 3}`` serves version 3 with its ``model.toml``;
``{"version": 3, "settings": {"outputs": ["score"], "intra_op_threads": 2}}``
serves it with those keys over its ``model.toml``'s, each key given replacing
the file's value whole (a table too: ``postprocess`` given is the whole
postprocessing). An empty value (a tombstone) unloads the model.

``topics`` sets the input topics of a model the record brings (one this worker
did not serve: ``worker.app.arrivals``), or gives a served model more (one
taken away is refused: a served model keeps its topics). Not settable here,
refused naming the key: what identifies a model (``name``, ``path``), its
changelog (``state_topic``, set at start-up), the engine it runs on
(``backend``: the control topic swaps versions on the CPU path), and
``reload_interval_s`` (a repository model's version is the topic's, not its
file's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The keys of a [models.NAME] a record may not set, with why.
FIXED = {
    "name": "a repository model is named by its directory",
    "path": "the model file is the version directory's",
    "state_topic": "a model's changelog is set at start-up",
    "backend": "the control topic swaps versions on the CPU path",
    "reload_interval_s": "a repository model's version is the control topic's",
}


@dataclass(frozen=True)
class Desired:
    """A model's desired state: a version (None: unloaded) and the settings over
    its ``model.toml``."""

    version: int | None
    settings: dict[str, Any] = field(default_factory=dict)

    def value(self) -> dict[str, Any] | None:
        """The record's value as JSON writes it (None: a tombstone)."""
        if self.version is None:
            return None
        return {"version": self.version, **({"settings": self.settings} if self.settings else {})}


def desired_state(value: bytes | None) -> Desired:
    """A record's desired state; ValueError saying why the value is not one."""
    if not value:
        return Desired(None)
    try:
        state = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    version = state.get("version") if isinstance(state, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f'{value[:80]!r}: expected {{"version": N}}, N a version directory '
                         "(a positive integer)")  # fmt: skip
    assert isinstance(state, dict)
    unknown = sorted(set(state) - {"version", "settings"})
    if unknown:
        raise ValueError(f"{unknown}: a desired state holds version and settings only")
    return Desired(version, checked_settings(state.get("settings", {})))


def checked_settings(settings: object) -> dict[str, Any]:
    """``settings`` as a record may carry them; ValueError naming what it may not."""
    if not isinstance(settings, dict):
        raise ValueError(f"settings: expected a table of [models.NAME] keys, got "
                         f"{type(settings).__name__}")  # fmt: skip
    for key in settings:
        if key in FIXED:
            raise ValueError(f"settings.{key}: not settable through the control topic "
                             f"({FIXED[key]})")  # fmt: skip
    return dict(settings)


def kept_topics(name: str, settings: dict[str, Any], topics: tuple[str, ...]) -> str | None:
    """Why a record's ``settings`` may not be applied to ``name``, served on
    ``topics``: taking one of them away (a served model keeps its topics and
    may be given more), or None."""
    given = settings.get("topics")
    if given is None or set(topics) <= set(given):
        return None
    return (f"settings.topics: {name!r} answers {list(topics)}; a record may give a served "
            "model more topics, never take one away (that is a new configuration)")  # fmt: skip


def carried(state: Desired, last: bytes | None) -> Desired:
    """``state`` with the ``topics`` of the model's last record where it names
    none: a record is the model's whole desired state (a member started after
    compaction reads only the last one), and topics a record gave it must not
    be forgotten by the next (``models load`` and the OIP load write so)."""
    if state.version is None or "topics" in state.settings or not last:
        return state
    try:
        before = desired_state(last)
    except ValueError:
        return state
    if "topics" not in before.settings:
        return state
    return Desired(state.version, {**state.settings, "topics": before.settings["topics"]})
