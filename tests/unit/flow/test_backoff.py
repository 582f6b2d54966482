"""The one Backoff and the one Deadline (worker/flow/backoff.py)."""

from __future__ import annotations

import pytest

from worker.flow.backoff import Backoff
from worker.flow.deadline import Deadline


def test_backoff_doubles_to_its_cap_with_jitter_and_resets() -> None:
    draws: list[tuple[float, float]] = []

    def uniform(lo: float, hi: float) -> float:
        draws.append((lo, hi))
        return hi  # the largest factor

    b = Backoff(0.2, cap=1.0, uniform=uniform)
    assert [round(b.next(), 3) for _ in range(5)] == [0.25, 0.5, 1.0, 1.25, 1.25]
    assert draws == [(0.75, 1.25)] * 5
    b.reset()
    assert b.current == 0.2


def test_backoff_without_jitter_and_bad_bounds() -> None:
    b = Backoff(0.1, cap=5.0, jitter=(1.0, 1.0))
    delays = [b.next() for _ in range(100)]  # a long outage: no overflow, capped
    assert delays[:3] == [0.1, 0.2, 0.4] and delays[-1] == 5.0
    with pytest.raises(ValueError, match="first"):
        Backoff(0.0)
    with pytest.raises(ValueError, match="cap"):
        Backoff(2.0, cap=1.0)


def test_deadline_counts_down_and_keeps_a_floor() -> None:
    now = [100.0]
    d = Deadline(5.0, clock=lambda: now[0])
    assert d.left() == 5.0 and not d.expired
    now[0] = 103.0
    assert d.left() == 2.0 and d.elapsed() == 3.0
    now[0] = 110.0
    assert d.expired and d.left() == 0.0 and d.left(0.5) == 0.5
