"""Worker processes driven from outside: spawn, scrape metrics, wait, stop.

The demo and the benchmark (and the integration tests) talk to the worker
exactly as an operator's tooling would: environment overrides in, Prometheus
metrics out, signals to stop it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.flow.deadline import Deadline
from worker.ops.broker import create_topics, free_port
from worker.ops.children import kill_tree


@dataclass
class WorkerProcess:
    """A ``python -m worker`` child process with its metrics port and log file."""

    proc: subprocess.Popen[bytes]
    metrics_port: int
    log_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def member_metrics(self, procs: int) -> list[dict[str, float]]:
        """Each member's metrics when this process is ``run --procs N``: the
        supervisor serves none, member i serves them on ``metrics_port + i``."""
        return [scrape(self.metrics_port + i) for i in range(procs)]

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])

    def wait_until(
        self, predicate: Any, timeout: float = 30.0, what: str = "condition"
    ) -> dict[str, float]:
        """Poll the metrics until ``predicate(metrics)`` holds (a process-external
        condition, so polling is the only way to observe it)."""
        budget = Deadline(timeout)
        last: dict[str, float] = {}
        while not budget.expired:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"worker exited with {self.proc.returncode} while waiting for {what}:\n"
                    + self.log_tail()
                )
            try:
                last = self.metrics()
            except OSError:
                last = {}
            if last and predicate(last):
                return last
            time.sleep(0.05)
        raise TimeoutError(
            f"worker: {what} not reached in {timeout}s; metrics={last}\n" + self.log_tail()
        )

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the process and everything it started: ``run --procs N``'s
        members run in sessions of their own, and killing their supervisor
        alone left them running (``worker.ops.children``)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.wait()


def override_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """``section.key=value`` settings as the worker's environment variables."""
    return {
        "INFER_WORKER_" + "__".join(part.upper() for part in key.split(".")): value
        for key, value in overrides.items()
    }


def extended_pythonpath(*entries: str | os.PathLike[str], base: str | None = None) -> str:
    """``entries`` in front of ``base`` (default: this process's PYTHONPATH),
    duplicates and empty entries dropped. A child's environment extends
    PYTHONPATH and never replaces it: the GPU machine's packages live in a
    directory that only PYTHONPATH names (scripts/gpu_session.sh), so a child
    given a PYTHONPATH of its own fails at its first import there."""
    inherited = os.environ.get("PYTHONPATH", "") if base is None else base
    out: list[str] = []
    given = [os.fspath(e) for e in entries]
    for entry in os.pathsep.join([*given, inherited]).split(os.pathsep):
        if entry and entry not in out:
            out.append(entry)
    return os.pathsep.join(out)


def worker_env(
    bootstrap: str,
    *,
    input_topics: Sequence[str],
    output_topic: str,
    dlq_topic: str,
    group_id: str,
    metrics_port: int,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """This process's environment (its ``INFER_WORKER_*`` settings dropped), the
    worker's settings for these topics, then ``extra``; a ``PYTHONPATH`` in
    ``extra`` goes in front of the inherited one (``extended_pythonpath``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    env.update(
        {
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "INFER_WORKER_KAFKA__INPUT_TOPICS": ",".join(input_topics),
            "INFER_WORKER_KAFKA__OUTPUT_TOPIC": output_topic,
            "INFER_WORKER_KAFKA__DLQ_TOPIC": dlq_topic,
            "INFER_WORKER_KAFKA__GROUP_ID": group_id,
            # Short group timeouts: the embedded broker's rebalance wait is ~session/2.
            "INFER_WORKER_KAFKA__SESSION_TIMEOUT_MS": "3000",
            "INFER_WORKER_KAFKA__HEARTBEAT_INTERVAL_MS": "500",
            # Tansu holds a fetch for the full fetch_max_wait_ms even when data arrives
            # (Kafka answers as soon as fetch_min_bytes is there): keep the wait short.
            "INFER_WORKER_KAFKA__FETCH_MAX_WAIT_MS": "10",
            "INFER_WORKER_METRICS__PORT": str(metrics_port),
            "INFER_WORKER_METRICS__HOST": "127.0.0.1",
            "INFER_WORKER_LOGGING__FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
        }
    )
    extra = dict(extra or {})
    if "PYTHONPATH" in extra:
        inherited = env.get("PYTHONPATH", "")
        extra["PYTHONPATH"] = extended_pythonpath(extra["PYTHONPATH"], base=inherited)
    env.update(extra)
    return env


def spawn_worker(
    bootstrap: str,
    *,
    input_topics: Sequence[str],
    output_topic: str,
    dlq_topic: str,
    group_id: str,
    extra_env: Mapping[str, str] | None = None,
    command: Sequence[str] = ("run",),
    argv: Sequence[str] | None = None,
    members: int = 0,
) -> WorkerProcess:
    """Start ``python -m worker COMMAND`` (or ``argv`` as given, e.g. a baseline
    script taking the same environment) against ``bootstrap``. ``members``: the
    processes ``run`` starts (0: one per ``--procs``; lanes of their own add theirs)."""
    # ``run --procs N``: member i serves its metrics on port + i.
    procs = int(command[command.index("--procs") + 1]) if "--procs" in command else 1
    port = free_port(members or procs)
    env = worker_env(
        bootstrap,
        input_topics=input_topics,
        output_topic=output_topic,
        dlq_topic=dlq_topic,
        group_id=group_id,
        metrics_port=port,
        extra=extra_env,
    )
    log = tempfile.NamedTemporaryFile(prefix="worker-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        list(argv) if argv is not None else [sys.executable, "-m", "worker", *command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return WorkerProcess(proc, port, log.name)


async def spawn_on_fresh_topics(
    bootstrap: str,
    prefix: str,
    partitions: int,
    *,
    group_id: str,
    extra_env: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
) -> tuple[dict[str, str], WorkerProcess]:
    """Create ``PREFIX.requests`` and ``PREFIX.results`` (``partitions`` each) and
    ``PREFIX.dlq``, and start a worker (or ``argv``) on them: one contender of a
    demo, sweep or benchmark, isolated from the others on one broker."""
    topics = {kind: f"{prefix}.{kind}" for kind in ("requests", "results", "dlq")}
    await create_topics(
        bootstrap,
        {topics["requests"]: partitions, topics["results"]: partitions, topics["dlq"]: 1},
    )
    worker = spawn_worker(
        bootstrap,
        input_topics=[topics["requests"]],
        output_topic=topics["results"],
        dlq_topic=topics["dlq"],
        group_id=group_id,
        extra_env=extra_env,
        argv=argv,
    )
    return topics, worker


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int, timeout: float = 2.0) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (comments skipped).

    One process serves one model, so the inference metrics' ``model`` and
    ``version`` labels are folded away (series differing only in them are
    summed): readers ask for ``infer_batches_total{reason="full"}`` whatever
    model runs."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        key = _fold_model_labels(series)
        out[key] = out.get(key, 0.0) + number
    return out


def _fold_model_labels(series: str) -> str:
    """Drop the ``model``/``version`` labels every inference metric carries
    (``metrics.ModelMetrics``); an ``*_info`` series, whose labels are the
    information itself, stays whole."""
    name, brace, labels = series.partition("{")
    if not brace or name.endswith("_info"):
        return series
    pairs = _LABEL.findall(labels)
    kept = [f'{k}="{v}"' for k, v in pairs if k not in ("model", "version")]
    if len(kept) == len(pairs):
        return series
    return f"{name}{{{','.join(kept)}}}" if kept else name


def summed(members: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Several members' metrics as one group's: every series added up."""
    out: dict[str, float] = {}
    for m in members:
        for key, value in m.items():
            out[key] = out.get(key, 0.0) + value
    return out


def mean_batch_size(m: Mapping[str, float]) -> float:
    count = m.get("infer_batch_size_count", 0.0)
    return m.get("infer_batch_size_sum", 0.0) / count if count else 0.0
