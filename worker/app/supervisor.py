"""``infer-worker run --procs N``, and lanes of their own: several worker
processes, one consumer group, one host.

One Python process is bound by one core for its per-record work (the GIL), so
a host with more cores, or one GPU fed by more than one core, serves more with
more members of the same group; this starts them and stops them together.

A lane with ``own_process = true`` is served by members of its own: each of the
N members is then one process for the lanes that share (their batches, in
priority order) and one per lane of its own, whose requests wait behind no other
lane's Python (docs/guides/lanes.md). Members of one group may subscribe to
different topics; each partition still has one owner, which keeps its order,
its commits and its transactions.

Each child is ``python -m worker run`` with the same configuration (file and
``INFER_WORKER_*`` variables) and its own (``members``): metrics on
``metrics.port + i`` (or none when the port is 0), ``kafka.client_id`` suffixed
``-i``; where there is more than one child, ``group_instance_id`` and
``transactional_id`` (when set) suffixed with the member (``-1``, ``-urgent``,
``-1-urgent``), since two members with one static id fence each other; and, with
lanes of their own, the child's input topics and lanes. SIGTERM/SIGINT are passed
to every child (a second one too, which abandons their drains), and the
supervisor exits with the worst child status. A child that exits on its own
stops the others: this is not a restart policy (leave that to the orchestrator,
which then sees one failed unit), it keeps a half-sized group from running
unnoticed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Final

import structlog
from aiokafka.errors import KafkaError

from worker.compute.engines import is_gpu_backend
from worker.compute.gpu.budget import resolve_fraction
from worker.config import LaneConfig, Settings
from worker.config.lanes import lanes_literal, strings_literal
from worker.config.models import served
from worker.flow.errors import ConfigError
from worker.kafka.topiccheck import idle_members, partition_counts

log = structlog.get_logger("worker")


def supervised(settings: Settings, procs: int) -> bool:
    """Whether ``run`` starts member processes rather than serving in this one."""
    return procs > 1 or any(lane.own_process for lane in settings.kafka.lanes)


def members(settings: Settings, procs: int) -> list[dict[str, str]]:
    """Each child's settings over the shared configuration, in start order: per
    member index, the process of the lanes that share, then one per lane of its
    own (most urgent first)."""
    k = settings.kafka
    alone = [lane for lane in k.ranked_lanes if lane.own_process]
    shared = [lane for lane in k.ranked_lanes if not lane.own_process]
    # (suffix, lanes): no lanes = the configured input topics and lanes as they are
    groups: list[tuple[str, list[LaneConfig]]] = [("", [])]
    if alone:
        groups = [("", shared)] if shared else []
        groups += [(lane.label, [lane]) for lane in alone]
    out: list[dict[str, str]] = []
    for i in range(procs):
        for suffix, lanes in groups:
            env = {
                "INFER_WORKER_METRICS__PORT": str(
                    settings.metrics.port + len(out) if settings.metrics.port else 0
                ),
                "INFER_WORKER_KAFKA__CLIENT_ID": f"{k.client_id}-{len(out)}",
                "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": k.bootstrap_servers,
            }
            if lanes:
                topics = [t for lane in lanes for t in lane.topics]
                env["INFER_WORKER_KAFKA__INPUT_TOPICS"] = strings_literal(topics)
                env["INFER_WORKER_KAFKA__LANES"] = lanes_literal(
                    [dataclasses.replace(lane, own_process=False) for lane in lanes]
                )
            member = "-".join(part for part in (str(i) if procs > 1 else "", suffix) if part)
            if member and k.group_instance_id:
                env["INFER_WORKER_KAFKA__GROUP_INSTANCE_ID"] = f"{k.group_instance_id}-{member}"
            if member and k.transactional_id:
                env["INFER_WORKER_KAFKA__TRANSACTIONAL_ID"] = f"{k.transactional_id}-{member}"
            out.append(env)
    if any(is_gpu_backend(m.config.backend) for m in served(settings)):
        # Every member on one device (gpu.device): each gets an equal share of its
        # memory unless one is set (worker.compute.gpu.budget).
        share = resolve_fraction(settings.gpu.memory_fraction, len(out))
        for env in out:
            env["INFER_WORKER_GPU__MEMORY_FRACTION"] = repr(share)
    return out


def child_env(base: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: this process's, then its member's settings
    (which win over the configuration file, as every ``INFER_WORKER_*`` does)."""
    return {**base, **overrides}


def child_envs(
    settings: Settings,
    planned: Sequence[Mapping[str, str]],
    environ: Mapping[str, str],
    cpus: int | None,
) -> list[dict[str, str]]:
    """Every child's whole environment, in ``planned``'s order."""
    base = {**environ, **compile_threads(settings, environ, len(planned), cpus)}
    return [child_env(base, overrides) for overrides in planned]


COMPILE_THREADS: Final = "TORCHINDUCTOR_COMPILE_THREADS"


def compile_threads(
    settings: Settings, environ: Mapping[str, str], members: int, cpus: int | None
) -> dict[str, str]:
    """torch's compile workers split among the members: each member's inductor
    otherwise starts a pool of one worker per core (up to 32), so four members on
    16 cores held 64 (four compile pools of 16 in the H200 profile of `--procs
    4`, each about 13 s of start-up CPU). An operator's setting is kept; other
    engines compile nothing."""
    torch = any(m.config.backend == "torch" for m in served(settings))
    if not torch or members <= 1 or COMPILE_THREADS in environ:
        return {}
    return {COMPILE_THREADS: str(max(1, (cpus or 1) // members))}


def supervise(settings: Settings, procs: int, config: str | None) -> int:
    """Run the member processes (``members``) until a signal or until one exits."""
    argv: Sequence[str] = [sys.executable, "-m", "worker", "run"]
    if config:
        argv = [*argv, "--config", config]
    planned = members(settings, procs)
    _check_partitions(settings, planned)
    envs = child_envs(settings, planned, os.environ, os.cpu_count())
    children = [
        # Own sessions: Ctrl-C in a terminal reaches the supervisor alone, which
        # passes it on once (twice would abandon every drain).
        subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        for env in envs
    ]
    held = [
        {"member": m["INFER_WORKER_KAFKA__CLIENT_ID"], "pid": c.pid,
         "topics": _topics_of(settings, m), "metrics_port": int(m["INFER_WORKER_METRICS__PORT"]),
         **({"gpu": f"cuda:{settings.gpu.device}",
             "gpu_memory_fraction": float(m["INFER_WORKER_GPU__MEMORY_FRACTION"])}
            if "INFER_WORKER_GPU__MEMORY_FRACTION" in m else {})}
        for m, c in zip(planned, children, strict=True)
    ]  # fmt: skip
    log.info("supervising", procs=procs, members=held, compile_threads=envs[0].get(COMPILE_THREADS))
    signals: list[int] = []

    def forward(signum: int, _: FrameType | None) -> None:
        signals.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while all(c.poll() is None for c in children) and not signals:
            time.sleep(0.2)
        if not signals:  # one exited on its own: stop the rest, drained
            early = next(c for c in children if c.poll() is not None)
            log.error("member_exited", pid=early.pid, status=early.returncode)
            forward(signal.SIGTERM, None)
        codes = [c.wait() for c in children]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("supervisor_stopped", statuses=codes)
    return max(codes, key=_severity)


def _topics_of(settings: Settings, member: Mapping[str, str]) -> list[str]:
    """The input topics a member reads: its lane's (a JSON array, as
    ``strings_literal`` writes it), else the configuration's."""
    own = member.get("INFER_WORKER_KAFKA__INPUT_TOPICS")
    return json.loads(own) if own is not None else list(settings.kafka.input_topics)


def _check_partitions(settings: Settings, planned: Sequence[Mapping[str, str]]) -> None:
    """Refuse to start members that would hold no partition (``idle_members``).
    Asked of the cluster once, briefly: a broker that does not answer is left to
    the members, which name it as the worker does."""
    groups: dict[tuple[str, ...], int] = {}
    for member in planned:
        key = tuple(_topics_of(settings, member))
        groups[key] = groups.get(key, 0) + 1
    if all(n <= 1 for n in groups.values()):
        return
    k = dataclasses.replace(settings.kafka, request_timeout_ms=5000)
    try:
        counts = asyncio.run(partition_counts(k, {t for key in groups for t in key}))
    except (KafkaError, OSError, TimeoutError) as exc:
        log.warning("partitions_not_checked", reason=repr(exc))
        return
    problem = idle_members(list(groups.items()), counts)
    if problem is not None:
        raise ConfigError(problem)


def _severity(code: int) -> int:
    """Worst first: killed by a signal (negative), failed (1), undrained (2), ok."""
    return {0: 0, 2: 1, 1: 2}.get(code, 3)
