"""A lane's rate cap (``[[kafka.lanes]] max_records_per_s``): how many of its
requests a second go into batches, at most. Pure, injected clock.

Why a cap and not only a priority: the worker rarely has its host to itself. On
the 2-core machine the benchmarks run on, a bulk lane draining flat out took
the CPU the broker and the urgent lane's own process needed, and the urgent p99
went to 2-4x its figure alone, though the worker served urgent requests first
(BENCHMARKS.md, "Priority lanes: a bulk lane held to a rate"). A backfill held
to a rate leaves that headroom, and is what operators already do to a backfill.

A token bucket of at most ``burst`` rows (two batches, ``BURST_BATCHES``):
after an idle spell the lane may take two batches at once, never more; under a
backlog it gets one batch each ``batch / rate`` seconds. Two, not one: a batch
waits for the engine as well as for the cap, and a bucket of one batch, full
while it waited, dropped what it would have gained meanwhile (a cap of 7,020 a
second gave 5,554-6,428). Requests held back wait in the lane, in order;
their deadlines still apply (one that passes while it waits is answered
``deadline_exceeded``, as any late request is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Float slack, so the time ``ready_at`` names really has the rows.
_EPS = 1e-9

BURST_BATCHES = 2  # a capped lane's bucket holds this many batches' rows


@dataclass
class Throttle:
    rate: float  # rows a second, > 0
    burst: int  # the most rows taken at once (the batch size)
    _tokens: float = field(init=False)
    _at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        assert self.rate > 0 and math.isfinite(self.rate) and self.burst >= 1
        self._tokens = float(self.burst)

    def available(self, now: float) -> int:
        """Rows that may be taken at ``now``."""
        self._refill(now)
        return int(self._tokens + _EPS)

    def ready_at(self, rows: int) -> float:
        """When ``rows`` (at most ``burst``) may be taken: now or later. Before the
        first take, at once (-inf)."""
        rows = min(rows, self.burst)
        if self._at is None or self._tokens + _EPS >= rows:
            return -math.inf if self._at is None else self._at
        return self._at + (rows - self._tokens) / self.rate

    def take(self, rows: int, now: float) -> None:
        """``rows`` taken at ``now`` (at most ``available(now)``)."""
        self._refill(now)
        self._tokens = max(0.0, self._tokens - rows)

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        if self._at is None or now > self._at:
            self._at = now


def lane_throttle(rate: float, batch_size: int) -> Throttle | None:
    """A capped lane's throttle for batches of ``batch_size`` rows (a bucket of
    ``BURST_BATCHES`` of them); None for ``rate`` 0, no cap."""
    return Throttle(rate, BURST_BATCHES * batch_size) if rate > 0 else None
