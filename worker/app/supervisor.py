"""``infer-worker run --procs N``: N worker processes, one consumer group, one host.

One Python process is bound by one core for its per-record work (the GIL), so
a host with more cores, or one GPU fed by more than one core, serves more with
more members of the same group; this starts them and stops them together.

Each child is ``python -m worker run`` with the same configuration (file and
``INFER_WORKER_*`` variables), metrics on ``metrics.port + i`` (or none when the
port is 0), and ``kafka.client_id`` suffixed ``-i``. SIGTERM/SIGINT are passed
to every child (a second one too, which abandons their drains), and the
supervisor exits with the worst child status. A child that exits on its own
stops the others: this is not a restart policy (leave that to the orchestrator,
which then sees one failed unit), it keeps a half-sized group from running
unnoticed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

import structlog

from worker.config import Settings

log = structlog.get_logger("worker")


def child_env(settings: Settings, index: int, base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    port = settings.metrics.port
    env["INFER_WORKER_METRICS__PORT"] = str(port + index if port else 0)
    env["INFER_WORKER_KAFKA__CLIENT_ID"] = f"{settings.kafka.client_id}-{index}"
    env["INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS"] = settings.kafka.bootstrap_servers
    return env


def supervise(settings: Settings, procs: int, config: str | None) -> int:
    """Run ``procs`` workers until a signal or until one of them exits."""
    argv: Sequence[str] = [sys.executable, "-m", "worker", "run"]
    if config:
        argv = [*argv, "--config", config]
    children = [
        # Own sessions: Ctrl-C in a terminal reaches the supervisor alone, which
        # passes it on once (twice would abandon every drain).
        subprocess.Popen(
            argv,
            env=child_env(settings, i, os.environ),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        for i in range(procs)
    ]
    log.info("supervising", procs=procs, pids=[c.pid for c in children])
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


def _severity(code: int) -> int:
    """Worst first: killed by a signal (negative), failed (1), undrained (2), ok."""
    return {0: 0, 2: 1, 1: 2}.get(code, 3)
