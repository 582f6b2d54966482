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
often. A young collection every 10,000 net allocations (700 by default), a
middle one every 50 young ones, a full one every 100 middle ones (about once a
minute at full load): cyclic garbage still goes, later, and the full
collections that stop the loop are rare and walk only what serving made.
Prometheus' ``python_gc_*`` series show the counts.
"""

from __future__ import annotations

import gc
from typing import Final

import structlog

log = structlog.get_logger(__name__)

THRESHOLDS: Final = (10_000, 50, 100)


def settle_for_serving() -> None:
    """Freeze what start-up made and collect less often (call once, started)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    log.info("gc_settled", frozen_objects=gc.get_freeze_count(), thresholds=list(THRESHOLDS))
