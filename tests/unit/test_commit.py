"""The per-partition contiguous watermark, with out-of-order completion."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.commit import OffsetTracker, TopicPartition

A = TopicPartition("in", 0)
B = TopicPartition("in", 1)


def test_watermark_waits_for_the_lowest_pending_offset() -> None:
    t = OffsetTracker()
    for off in (10, 11, 12):
        t.track(A, off)
    t.done(A, 12)
    t.done(A, 11)
    assert t.committable() == {}
    t.done(A, 10)
    assert t.committable() == {A: 13}
    assert t.in_flight(A) == 0


def test_partitions_are_independent_and_commits_are_not_repeated() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    t.track(B, 5)
    t.track(B, 6)
    t.done(B, 5)
    assert t.committable() == {B: 6}
    t.mark_committed({B: 6})
    assert t.committable() == {}
    t.done(A, 0)
    assert t.committable() == {A: 1}


def test_committable_only_for_owned_partitions() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    t.track(B, 0)
    t.done(A, 0)
    t.done(B, 0)
    assert t.committable(owned={B}) == {B: 1}


def test_gaps_in_offsets_are_fine() -> None:
    """Compacted topics and transaction markers leave gaps between offsets."""
    t = OffsetTracker()
    t.track(A, 3)
    t.track(A, 7)
    t.done(A, 7)
    t.done(A, 3)
    assert t.committable() == {A: 8}


def test_forgotten_partition_ignores_stale_results() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    assert t.owns(A, 0)
    t.forget([A])
    assert not t.owns(A, 0)
    t.done(A, 0)
    assert t.committable() == {}


def test_out_of_order_tracking_is_rejected() -> None:
    t = OffsetTracker()
    t.track(A, 5)
    with pytest.raises(ValueError):
        t.track(A, 5)


@given(st.permutations(list(range(30))), st.integers(min_value=0, max_value=30))
def test_watermark_is_first_not_done(order: list[int], n_done: int) -> None:
    t = OffsetTracker()
    for off in range(30):
        t.track(A, off)
    done = set(order[:n_done])
    for off in order[:n_done]:
        t.done(A, off)
    first_missing = next((o for o in range(30) if o not in done), 30)
    expected = {A: first_missing} if first_missing > 0 else {}
    assert t.committable() == expected
    assert t.in_flight(A) == 30 - first_missing
