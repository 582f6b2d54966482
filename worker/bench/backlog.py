"""How many records ``bench --model`` drains: enough for ten seconds at the
rate the drain is expected to reach.

A fixed count measures different things on different machines: 20,000 records
last one second at 20k img/s, most of it start and end effects. The backlog is
sized by time instead, from the lowest of three rates:

- the engine alone, measured in the same run just before (no drain beats it);
- ``PROCESS_RATE`` for the model and payload, times the worker processes;
- what the broker delivers, ``BROKER_BYTES_S`` over the mean record size (the
  embedded broker's one reader measured 290-320 MB/s on the 16-core H200 host).

The broker's bound also keeps the backlog's bytes to what ten seconds at that
rate hold (3.2 GB), which the embedded broker keeps in memory and which is
produced before the drain. Overestimating the rate costs time; underestimating
it shortens the drain, which the run then reports (``short_drain_note``) with
the ``--records`` that would fill ten seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

DRAIN_SECONDS: Final = 10.0
# Worker drain, images/s per process. digits (onnxruntime): measured here on 2
# cores, one process, 20,000 records: raw 10.4k, png 4.3k, jpeg 3.9k; x1.5 for
# faster hosts. resnet50 (H200, 2026-11-28, BENCHMARKS.md "GPU"): one process
# drained 5.9k JPEGs/s, four 14.8k, where the broker's reader bound them; PNG
# decodes on the host (about 1.4k img/s per core for PIL's JPEG, PNG no faster,
# not measured on a GPU); raw is bound by the broker's bytes at any count.
PROCESS_RATE: Final[dict[tuple[str, str], float]] = {
    ("digits", "raw"): 15_000.0,
    ("digits", "png"): 6_500.0,
    ("digits", "jpeg"): 6_000.0,
    ("resnet50", "jpeg"): 6_000.0,
    ("resnet50", "png"): 2_000.0,
    ("resnet50", "raw"): 6_000.0,
    # sentiment (onnxruntime, tokenized in the worker): benchmarks.drain --payload text
    # measured 5.2k-5.9k texts/s here; x1.5 as above.
    ("sentiment", "text"): 8_500.0,
}
# The embedded broker's one reader on the H200's host: 290 MB/s of 19.6 kB JPEG
# records, 320 MB/s of 197 kB raw ones (the bench's ingest ceilings, 2026-11-28).
BROKER_BYTES_S: Final = 320e6
MIN_RECORDS: Final = 1_000


@dataclass(frozen=True)
class Backlog:
    records: int
    expected_rate: float  # images/s the drain is expected to reach
    bound: str  # what set expected_rate: "engine", "processes" or "broker"

    @property
    def seconds(self) -> float:
        """The drain's expected length."""
        return self.records / self.expected_rate if self.expected_rate > 0 else 0.0


def plan_backlog(
    model: str,
    payload: str,
    procs: int,
    engine_img_s: float,
    record_bytes: float,
    seconds: float = DRAIN_SECONDS,
) -> Backlog:
    """The backlog for ``seconds`` of drain at the expected rate (see the module
    docstring), at least ``MIN_RECORDS``."""
    bounds = {
        "engine": engine_img_s,
        "processes": PROCESS_RATE[(model, payload)] * procs,
        "broker": BROKER_BYTES_S / max(record_bytes, 1.0),
    }
    bound = min(bounds, key=lambda k: bounds[k])
    rate = bounds[bound]
    return Backlog(max(MIN_RECORDS, math.ceil(rate * seconds)), rate, bound)


def short_drain_note(
    drain_seconds: float, rate: float, records: int, seconds: float = DRAIN_SECONDS
) -> str | None:
    """What to say when the drain lasted less than ``seconds``: the worker was
    faster than expected, so the steady state was short; None otherwise."""
    if drain_seconds >= seconds or rate <= 0:
        return None
    enough = max(records + 1, math.ceil(records * seconds / max(drain_seconds, 1e-3) * 1.2))
    return (
        f"the drain lasted {drain_seconds:.1f} s, under {seconds:g} s ({rate:,.0f} img/s "
        f"is faster than expected): rerun with --records {enough} for a longer steady state"
    )
