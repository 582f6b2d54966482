"""Python's cycle collector, set once for serving.

Reference counting frees almost everything the hot path makes (records, jobs,
rows, arrays); the cycle collector only finds garbage in reference cycles,
which serving makes little of. With CPython's defaults it still ran about
1,700 young, 155 middle and 15 full collections in a 100,000-record drain, 7%
of the drain's time, and each full one stopped the event loop for 20-44 ms
(measured with ``gc.callbacks``, BENCHMARKS.md "The cycle collector"): the
requests in flight live long enough to be promoted, and a full collection walks
every object the process holds, the model runtime's included.

So, once started: collect what start-up left, freeze the survivors (the
modules, the engine, the stages: later collections skip them), and collect less
often. A young collection every 100,000 net allocations (700 by default), a
middle one every 50 young ones, a full one every 100 middle ones. The young
threshold was 10,000 until 2026-11-27: a 100,000-record drain then still ran
about 70 young collections, 190-240 ms in all, on the event loop (4-5% of the
worker's CPU, a 3 ms stall each time), because the records in flight swing
the net count past 10,000 and every collection walks them; at 100,000 the same
drain ran none (BENCHMARKS.md, "The cycle collector's young threshold").
Cyclic garbage still goes, later: what is not freed counts towards the
threshold, so at most about 100,000 objects of it wait. Prometheus'
``python_gc_*`` series show the counts.
"""

from __future__ import annotations

import gc
from typing import Final

import structlog

log = structlog.get_logger(__name__)

THRESHOLDS: Final = (100_000, 50, 100)


def settle_for_serving() -> None:
    """Freeze what start-up made and collect less often (call once, started)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    log.info("gc_settled", frozen_objects=gc.get_freeze_count(), thresholds=list(THRESHOLDS))
