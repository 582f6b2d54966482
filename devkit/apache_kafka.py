"""Apache Kafka started by the project itself: one KRaft node or three.

``KafkaCluster`` formats KRaft storage in a temporary directory, starts each
node as ``java -cp '<libs>/*' kafka.Kafka server.properties`` on free loopback
ports (every node is both broker and controller, with a static quorum), and
returns from ``start()`` once the cluster answers metadata with every broker and
the group coordinator is up. It offers what tests use of the embedded broker
(``bootstrap``, ``start()``, ``stop()``, a context manager) plus per-node faults:
``kill`` (SIGKILL), ``pause``/``resume`` (SIGSTOP/SIGCONT), and
``stop_node``/``start_node`` (a restart that keeps the node's data).

The broker settings (test-only ones included, and why) are in
``devkit/kafka_settings.py``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from devkit.kafka_runtime import KAFKA_VERSION, java_binary, kafka_libs
from devkit.kafka_security import LISTENERS, PROTOCOL_MAP, Security
from devkit.kafka_settings import JVM_OPTIONS, LOG4J2, cluster_id, server_properties
from worker.ops.broker import BrokerError, BrokerKind, free_port, port_is_free


@dataclass
class _Node:
    node_id: int
    port: int  # client listener
    controller_port: int
    home: Path  # server.properties, data/, kafka.log
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.home / "kafka.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class KafkaCluster:
    """``nodes`` Apache Kafka KRaft nodes (1 or 3, say) on loopback ports.

    Nodes are numbered from 1 (their ``node.id``). ``stop()`` is idempotent and
    deletes the data; ``stop_node``/``start_node`` keep it. A node that fails to
    start leaves its directory behind and the error names its log."""

    kind: BrokerKind = "kafka"
    supports_transactions = True

    def __init__(
        self,
        nodes: int = 1,
        *,
        version: str = KAFKA_VERSION,
        startup_timeout: float = 120.0,
        properties: Mapping[str, str] | None = None,
        security: Security | None = None,
        port: int | None = None,
    ) -> None:
        """``port``: the first node's client port (its controller listens on the next
        one); None picks free loopback ports."""
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self._port = port
        self.version = version
        self.size = nodes
        self._startup_timeout = startup_timeout
        self._extra = dict(properties or {})
        self.security = security
        self._dir: Path | None = None
        self._keep_dir = False
        self._nodes: dict[int, _Node] = {}
        self._libs: Path | None = None

    # -- the surface shared with the embedded broker --------------------------------

    @property
    def bootstrap(self) -> str:
        if not self._nodes:
            raise BrokerError("the Kafka cluster is not started")
        return ",".join(f"127.0.0.1:{n.port}" for n in self._nodes.values())

    @property
    def running(self) -> bool:
        return any(n.running for n in self._nodes.values())

    def log_path(self, node: int = 1) -> Path:
        """Node ``node``'s JVM log (stdout and stderr)."""
        return self._node(node).log_path

    def start(self) -> KafkaCluster:
        """Fetch Kafka's jars if needed (once per machine), format and start every
        node, and wait until the cluster serves metadata and group coordination."""
        if self.running:
            return self
        self._libs = kafka_libs(self.version)
        security_on = self.security is not None
        self._dir = Path(tempfile.mkdtemp(prefix=f"kafka-{self.version}-"))
        self._keep_dir = False
        for i in range(1, self.size + 1):
            ports = 2 + (len(LISTENERS) if security_on else 0)
            port = self._port if i == 1 and self._port is not None else free_port(ports)
            home = self._dir / f"node-{i}"
            (home / "data").mkdir(parents=True)
            self._nodes[i] = _Node(i, port, port + 1, home)
        atexit.register(self.stop)
        try:
            cid = cluster_id()
            voters = ",".join(
                f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self._nodes.values()
            )
            for node in self._nodes.values():
                (node.home / "server.properties").write_text(self._properties(node, voters))
                (node.home / "log4j2.properties").write_text(LOG4J2)
            self._format_all(cid)
            for node in self._nodes.values():
                self._launch(node)
            self._wait_ready(set(self._nodes))
        except BaseException:
            self._keep_dir = True
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every node, SIGKILL those still up after 30 s; delete the data
        (kept when a start failed, for its logs). Idempotent."""
        for node in self._nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGCONT)  # a paused node cannot stop
                    node.proc.terminate()
        for node in self._nodes.values():
            self._reap(node, 30.0)
        self._nodes.clear()
        atexit.unregister(self.stop)
        if self._dir is not None and not self._keep_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- per-node faults -------------------------------------------------------------

    def kill(self, node: int) -> None:
        """SIGKILL: the node dies at once, without a controlled shutdown."""
        n = self._node(node)
        if n.proc is not None and n.proc.poll() is None:
            n.proc.kill()
        self._reap(n, 30.0)

    def pause(self, node: int) -> None:
        """SIGSTOP: the node holds its sockets open but answers nothing."""
        self._signal(node, signal.SIGSTOP)

    def resume(self, node: int) -> None:
        self._signal(node, signal.SIGCONT)

    def stop_node(self, *nodes: int, timeout: float = 30.0) -> None:
        """A clean stop (SIGTERM; SIGKILL after ``timeout``), data kept on disk.
        Several nodes are signalled together (the whole cluster, say: one by
        one, the last would wait for a controller quorum that is gone)."""
        stopping = [self._node(i) for i in nodes]
        for n in stopping:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)
                n.proc.terminate()
        for n in stopping:
            self._reap(n, timeout)

    def start_node(self, *nodes: int) -> None:
        """Start stopped or killed nodes again on their ports, with their data,
        and wait until the cluster lists them among its brokers (together: a
        controller quorum needs a majority of the voters up)."""
        starting = {i for i in nodes if not self._node(i).running}
        for i in sorted(starting):
            self._launch(self._nodes[i])
        if starting:
            self._wait_ready(starting)

    def node_port(self, node: int) -> int:
        return self._node(node).port

    def listener(self, name: str) -> str:
        """The bootstrap servers of the secured listener ``name`` (one of
        ``kafka_security.LISTENERS``); ``bootstrap`` stays the harness's own
        PLAINTEXT listener."""
        if self.security is None or name not in LISTENERS:
            raise BrokerError(f"no secured listener {name!r} (start with security=...)")
        offset = 2 + LISTENERS.index(name)
        return ",".join(f"127.0.0.1:{n.port + offset}" for n in self._nodes.values())

    # -- internals -------------------------------------------------------------------

    def _node(self, node: int) -> _Node:
        try:
            return self._nodes[node]
        except KeyError:
            raise BrokerError(f"no node {node} (nodes: {sorted(self._nodes)})") from None

    def _signal(self, node: int, sig: signal.Signals) -> None:
        n = self._node(node)
        if n.proc is None or n.proc.poll() is not None:
            raise BrokerError(f"node {node} is not running")
        n.proc.send_signal(sig)

    @staticmethod
    def _reap(node: _Node, timeout: float) -> None:
        proc, node.proc = node.proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _properties(self, node: _Node, voters: str) -> str:
        settings = server_properties(
            node.node_id, node.port, node.controller_port, voters, self.size, node.home / "data"
        )
        if self.security is not None:
            secured = [
                f"{name}://127.0.0.1:{node.port + 2 + i}" for i, name in enumerate(LISTENERS)
            ]
            settings["listeners"] += "," + ",".join(secured)
            settings["advertised.listeners"] += "," + ",".join(secured)
            settings["listener.security.protocol.map"] = PROTOCOL_MAP
            settings |= self.security.properties()
        return "".join(f"{k}={v}\n" for k, v in {**settings, **self._extra}.items())

    def _java(self, node: _Node, main: str, *args: str) -> list[str]:
        assert self._libs is not None
        return [
            java_binary(),
            *JVM_OPTIONS,
            f"-Dlog4j2.configurationFile={node.home / 'log4j2.properties'}",
            "-cp",
            f"{self._libs}/*",
            main,
            *args,
        ]

    def _format_all(self, cid: str) -> None:
        """``StorageTool format`` for every node, side by side (one JVM start each)."""
        procs = []
        for node in self._nodes.values():
            cmd = self._java(
                node, "kafka.tools.StorageTool", "format", "-t", cid,
                "-c", str(node.home / "server.properties"),
                *(self.security.format_arguments() if self.security else ()),
            )  # fmt: skip
            with open(node.home / "format.log", "wb") as out:
                procs.append((node, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)))
        for node, proc in procs:
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = -9
            if code != 0:
                raise BrokerError(
                    f"formatting Kafka storage failed (exit {code}); log: "
                    f"{node.home / 'format.log'}"
                )

    def _launch(self, node: _Node) -> None:
        with open(node.log_path, "ab") as out:
            node.proc = subprocess.Popen(
                self._java(node, "kafka.Kafka", str(node.home / "server.properties")),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=node.home,
            )

    def _wait_ready(self, started: set[int]) -> None:
        """Until every running node is listed by the cluster and the group
        coordinator answers; a node that exits meanwhile fails the start with its
        log named. Runs its client on a thread of its own: callers may be inside
        an event loop (an async test starting a broker)."""
        deadline = time.monotonic() + self._startup_timeout

        def dead() -> str | None:
            for i in started:
                n = self._nodes[i]
                if n.proc is None or n.proc.poll() is not None:
                    code = None if n.proc is None else n.proc.returncode
                    return f"Kafka node {i} exited with {code} at start; log: {n.log_path}"
            return None

        live = {i: n.port for i, n in self._nodes.items() if n.running}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(asyncio.run, _until_ready(live, deadline, dead))
            problem = fut.result()
        if problem is not None:
            self._keep_dir = True
            logs = ", ".join(str(self._nodes[i].log_path) for i in sorted(started))
            raise BrokerError(f"{problem}; log: {logs}" if "log:" not in problem else problem)


async def _until_ready(
    ports: Mapping[int, int], deadline: float, dead: Callable[[], str | None]
) -> str | None:
    """None once the brokers on ``ports`` are all in the cluster's metadata and a
    group coordinator is found (which creates the offsets topic on first use);
    else what went wrong."""
    bootstrap = ",".join(f"127.0.0.1:{p}" for p in ports.values())
    last = "no answer"
    while time.monotonic() < deadline:
        if (problem := dead()) is not None:
            return problem
        if not all(_accepts(p) for p in ports.values()):
            await asyncio.sleep(0.05)
            continue
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
            listed = {b["node_id"] for b in cluster["brokers"]}
            if set(ports) <= listed:
                await admin.find_coordinator("infer-worker.readiness")
                return None
            last = f"brokers listed: {sorted(listed)}"
        except (KafkaError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(KafkaError, OSError):
                await admin.close()
        await asyncio.sleep(0.1)
    return f"Kafka not ready after the startup timeout ({last})"


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def main() -> None:
    """``python -m devkit.apache_kafka [NODES] [--port PORT]``: start a cluster, print
    its bootstrap servers, and keep it up until interrupted (for trying things by
    hand). One node listens on 9092 when 9092 and 9093 are free (every example's
    address), else on free ports; ``--port`` asks for one."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m devkit.apache_kafka")
    parser.add_argument("nodes", type=int, nargs="?", default=1)
    parser.add_argument("--port", type=int, default=None,
                        help="the first node's client port (default 9092 when free)")  # fmt: skip
    args = parser.parse_args()
    port = args.port
    if port is None and args.nodes == 1 and port_is_free(9092) and port_is_free(9093):
        port = 9092
    stop = {signal.SIGINT, signal.SIGTERM}
    t0 = time.monotonic()
    with KafkaCluster(args.nodes, port=port) as cluster:
        print(
            f"Kafka {cluster.version}, {args.nodes} node(s), ready in "
            f"{time.monotonic() - t0:.1f}s: {cluster.bootstrap}\n"
            f"  export INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS={cluster.bootstrap}\n"
            "  (Ctrl-C stops it and deletes its data)",
            flush=True,
        )
        # Blocked only now, so the nodes (started above) do not inherit the mask.
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        signal.sigwait(stop)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
