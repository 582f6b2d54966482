"""Every check a worker makes before it contacts Kafka, run on its own: what
``infer-worker config`` runs, so ``config`` and ``run`` refuse the same
configurations (exit 2, naming the key) and ``config`` never passes a file that
``run`` would stop on before reaching the broker."""

from __future__ import annotations

import dataclasses

from worker.app.worker import Worker
from worker.config import Settings


async def checked(s: Settings) -> Settings:
    """``s`` once the worker's start-up checks passed (settings, client
    arguments, each model loaded, bound and probed, the memory budget, the
    pipelines' tensors, the stages built), with the batch size a worker of one
    model derives from it; raises what ``run`` would (``ConfigError``: exit 2)."""
    worker = Worker(s)
    try:
        await worker.prepare()
        sized = worker.settings
    finally:
        await worker.stop()  # never started: closes what prepare() opened
    if sized.batching is s.batching:
        return s
    return dataclasses.replace(s, batching=sized.batching)
