"""Shared fixtures: the real embedded broker and unique topic names per test.

A test run stopped by SIGTERM (``timeout``, as scripts/gpu_session.sh runs the
GPU suite) kills every process the tests started, brokers and workers and the
tools they ran, before it exits: none may run on into the next step.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
from collections.abc import Iterator

import pytest

from worker.tools.broker import EmbeddedBroker
from worker.tools.children import children_die_with_this_process

_on_sigterm = contextlib.ExitStack()


def pytest_configure(config: pytest.Config) -> None:
    # SIGINT stays pytest's: Ctrl-C still ends with a summary and teardowns.
    _on_sigterm.enter_context(children_die_with_this_process("pytest", (signal.SIGTERM,)))


def pytest_unconfigure(config: pytest.Config) -> None:
    _on_sigterm.close()


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
