"""What each model costs in memory, measured as it loads, and the budget the
models must fit together (``limits.max_models_memory_mb``).

A model's size is the process's resident memory after its engine loaded less
before (``/proc/self/statm``): its weights, the runtime's session and what the
load allocated. Loads run one after another at start-up, before the worker joins
the group, so each difference is that model's. What a model allocates later
(the runtime's arena growing with the first batches) is not in it: leave room.
Nor is memory the process freed before and the load reused (pages already
resident): at a worker's start little has been freed, but a process that ran
other work first (a test run) can measure a model smaller than it is.
The first model of a runtime also carries the runtime's own start (importing
onnxruntime and its first session: about 30 MiB, measured on this project's
machine with the bundled digits model, whose own share is under 1 MiB).
Where the resident size cannot be read (not Linux), models are measured as 0
and the log says so; the budget then refuses nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

import structlog

from worker.config.checks import check
from worker.obs import metrics

log = structlog.get_logger(__name__)

T = TypeVar("T")
MIB = 1 << 20


def resident_bytes() -> int | None:
    """The process's resident memory now, or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


async def measured(load: Callable[[], T]) -> tuple[T, int]:
    """``load()`` run off the event loop, and the resident bytes it added (0 where
    not measurable, or where memory was handed back meanwhile)."""
    before = resident_bytes()
    loaded = await asyncio.to_thread(load)
    after = resident_bytes()
    if before is None or after is None:
        return loaded, 0
    return loaded, max(0, after - before)


def check_budget(sizes: Mapping[str, tuple[str, int]], budget_mb: int) -> None:
    """Record each model's size (``infer_model_memory_bytes``; ``sizes``: by model
    name, its version and bytes), and refuse a total over ``budget_mb`` MiB (0: no
    budget) with exit 2 naming every model's share."""
    for name, (version, size) in sizes.items():
        metrics.MODEL_MEMORY.labels(model=name, version=version).set(size)
    if sizes:  # (none where every model is loaded by demand: those are logged as they load)
        log.info("models_memory", **{name: f"{size / MIB:.0f} MiB" for name, (_, size) in
                                     sizes.items()})  # fmt: skip
    if budget_mb == 0:
        return
    total = sum(size for _, size in sizes.values())
    shares = ", ".join(f"{name} {size / MIB:.0f} MiB" for name, (_, size) in sizes.items())
    check(total <= budget_mb * MIB, "limits.max_models_memory_mb",
          f"the models hold {total / MIB:.0f} MiB together ({shares}), over the budget of "
          f"{budget_mb} MiB: raise it, or serve some of them from a deployment of their "
          "own")  # fmt: skip


def start_runtime() -> None:
    """onnxruntime imported and its first session opened and closed, before any
    model loaded by demand is measured: what the runtime's own start adds (tens
    of MiB, most of it the import) is no model's, and a model counts the most
    any of its loads measured, so the first model loaded would otherwise count
    it for good."""
    import onnxruntime as ort

    from worker.model.files import resolve_model_path

    bundled = resolve_model_path("builtin:digits")
    ort.InferenceSession(str(bundled), providers=["CPUExecutionProvider"])
