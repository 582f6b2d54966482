"""Shared fixtures: the real embedded broker and unique topic names per test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from worker.tools.broker import EmbeddedBroker

_counter = itertools.count()


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def names(request: pytest.FixtureRequest) -> dict[str, str]:
    """Topic and group names no other test uses (the broker is shared)."""
    base = f"{request.node.name.replace('[', '-').replace(']', '')}-{next(_counter)}"
    return {
        "requests": f"{base}.requests",
        "results": f"{base}.results",
        "dlq": f"{base}.dlq",
        "group": f"{base}.group",
        "guard": f"{base}.guard",
    }
