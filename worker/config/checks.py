"""Helpers every settings section uses to validate and derive its values."""

from __future__ import annotations

import re

from worker.flow.errors import ConfigError


def derive(section: object, name: str, value: object) -> None:
    """Fill in a default derived from other settings (sections are frozen)."""
    object.__setattr__(section, name, value)


def check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def as_written(message: str, key: str) -> str:
    """``message`` of a model section's checks (which say ``model.KEY``) with the
    section named as the user wrote it (``models.NAME.KEY``)."""
    return re.sub(r"\bmodel\.(?=\w)", f"{key}.", message)  # model.KEY, not "the model."
