"""``infer-worker run --embedded``: a whole setup on one machine, without Docker.

Starts the embedded broker (on localhost:9092 when that port is free, else a
free port, and says which), creates the configured topics, runs the worker
against it until Ctrl-C, and prints the commands to try next. The broker keeps
everything in memory: topics and data go when this process ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

from worker.app.service import serve
from worker.app.supervisor import supervise, supervised
from worker.config import Settings
from worker.config.models import as_served
from worker.ops.broker import EmbeddedBroker, create_topics, port_is_free

DEFAULT_PORT = 9092


def run_embedded(settings: Settings, partitions: int, procs: int, config: str | None) -> int:
    k = settings.kafka
    port = DEFAULT_PORT if port_is_free(DEFAULT_PORT) else None
    with EmbeddedBroker(port=port) as broker:
        topics = {t: partitions for t in k.input_topics}
        topics |= {k.output_topic: partitions, k.dlq_topic: 1, k.crash_guard_topic: 1}
        asyncio.run(create_topics(broker.bootstrap, topics))
        bootstrap = f"localhost:{broker.port}"
        settings = dataclasses.replace(
            settings, kafka=dataclasses.replace(k, bootstrap_servers=bootstrap)
        )
        alone = as_served(settings)  # one model as one model (its lanes, its GPU)
        _tell(alone, broker.port, partitions)
        if supervised(alone, procs):  # --procs N, or lanes of their own
            return supervise(alone, procs, config)
        return asyncio.run(serve(settings))


def _tell(settings: Settings, port: int, partitions: int) -> None:
    k = settings.kafka
    flag = "" if port == DEFAULT_PORT else f" --bootstrap-servers localhost:{port}"
    moved = "" if port == DEFAULT_PORT else f" (port {DEFAULT_PORT} is taken: clients need{flag})"
    lines = [
        f"embedded broker on localhost:{port}{moved}",
        "  (in memory: its topics and data end with this process)",
        f"topics: {', '.join(k.input_topics)} ({partitions} partitions) -> {k.output_topic}, "
        f"errors to {k.dlq_topic}",
        f"worker: model {settings.model.name} on {settings.model.backend}; Ctrl-C stops both",
        "try, in another terminal:",
        f"  .venv/bin/infer-worker produce --samples 3{flag}",
        f"  .venv/bin/infer-worker produce my-image.png{flag}",
        f"  .venv/bin/infer-worker consume{flag}",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)
