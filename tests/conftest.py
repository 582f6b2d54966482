"""Shared fixtures: the real brokers and unique topic names per test.

``broker`` is parametrized over the embedded broker (Tansu) and Apache Kafka
(``devkit/apache_kafka.py``): every test that takes it runs on both, with
``[embedded]`` / ``[kafka]`` in its name. Each broker starts once per session,
and only when a test of its kind runs. Tests that need a broker of their own
(they stop or restart it) take ``broker_factory``, parametrized the same way.

Where Java or Maven is missing, or Kafka's jars cannot be fetched, the Kafka
tests skip with the reason; with ``CI=true`` that is an error instead, so CI
can never pass without having run them.

A test run stopped by SIGTERM (``timeout``, as scripts/gpu_session.sh runs the
GPU suite) kills every process the tests started, brokers and workers and the
tools they ran, before it exits: none may run on into the next step.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from collections.abc import Callable, Iterator

import pytest

from devkit.apache_kafka import KafkaCluster
from devkit.kafka_runtime import KafkaUnavailable, kafka_libs
from devkit.schema_registry import SchemaRegistryServer
from tests import required_tools
from worker.ops.broker import Broker, BrokerKind, EmbeddedBroker
from worker.ops.children import children_die_with_this_process

BROKER_KINDS: tuple[BrokerKind, ...] = ("embedded", "kafka")

_on_sigterm = contextlib.ExitStack()


def pytest_configure(config: pytest.Config) -> None:
    # SIGINT stays pytest's: Ctrl-C still ends with a summary and teardowns.
    _on_sigterm.enter_context(children_die_with_this_process("pytest", (signal.SIGTERM,)))


def pytest_unconfigure(config: pytest.Config) -> None:
    _on_sigterm.close()


@pytest.fixture
def torch_installed() -> None:
    """torch and torchvision, for the tests of the torch engine and the nvJPEG path
    on the CPU: a skip on a developer's machine without them, a failure in CI
    (which installs them: scripts/ci_tools.sh)."""
    required_tools.module("torch", required_tools.TORCH_INSTALL)
    required_tools.module("torchvision", required_tools.TORCH_INSTALL)


_counter = itertools.count()
_kafka_problem: list[KafkaUnavailable] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_kafka() -> None:
    """Skip (outside CI) or fail (in CI) where Apache Kafka cannot run here."""
    if not _kafka_problem:
        try:
            kafka_libs()
        except KafkaUnavailable as exc:
            _kafka_problem.append(exc)
        else:
            return
    problem = _kafka_problem[0]
    if _in_ci():
        raise problem
    pytest.skip(f"Apache Kafka unavailable: {problem}")


def new_broker(kind: BrokerKind, nodes: int = 1) -> Broker:
    """A started broker of ``kind`` (not shared: the caller stops it)."""
    if kind == "embedded":
        return EmbeddedBroker().start()
    require_kafka()
    return KafkaCluster(nodes).start()


@pytest.fixture(scope="session")
def embedded_broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaCluster]:
    require_kafka()
    with KafkaCluster() as b:
        yield b


@pytest.fixture(scope="session")
def schema_registry() -> Iterator[SchemaRegistryServer]:
    """A real Schema Registry (Apicurio's, in memory), once per test process.
    Tests register subjects named after their own topics."""
    try:
        server = SchemaRegistryServer().start()
    except KafkaUnavailable as exc:
        if _in_ci():
            raise
        pytest.skip(f"Schema Registry unavailable: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=BROKER_KINDS)
def broker_kind(request: pytest.FixtureRequest) -> BrokerKind:
    kind: BrokerKind = request.param
    return kind


@pytest.fixture
def broker(request: pytest.FixtureRequest, broker_kind: BrokerKind) -> Broker:
    """The session's broker of this test's kind (shared: tests use their own topics)."""
    b: Broker = request.getfixturevalue(f"{broker_kind}_broker")
    return b


@pytest.fixture
def broker_factory(broker_kind: BrokerKind) -> Iterator[Callable[[], Broker]]:
    """Starts brokers of this test's kind that the test may stop, kill or restart;
    whatever is still running at the end is stopped."""
    started: list[Broker] = []

    def make() -> Broker:
        b = new_broker(broker_kind)
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


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
