"""The per-partition contiguous watermark, with out-of-order completion."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.flow.backpressure import Backpressure
from worker.flow.budget import FailureBudget
from worker.flow.messages import TopicPartition
from worker.flow.offsets import OffsetTracker

A = TopicPartition("in", 0)
B = TopicPartition("in", 1)


def test_watermark_waits_for_the_lowest_pending_offset() -> None:
    t = OffsetTracker()
    e = [t.track(A, off, 10) for off in (10, 11, 12)]
    assert t.in_flight_bytes == 30
    t.done(A, 12, e[2])
    t.done(A, 11, e[1])
    assert t.committable() == {}
    assert t.in_flight_bytes == 10  # bytes are released at ack, not at the watermark
    t.done(A, 10, e[0])
    assert t.committable() == {A: 13}
    assert t.in_flight(A) == 0 and t.in_flight_bytes == 0


def test_partitions_are_independent_and_commits_are_not_repeated() -> None:
    t = OffsetTracker()
    ea = t.track(A, 0)
    eb = t.track(B, 5)
    t.track(B, 6)
    t.done(B, 5, eb)
    assert t.committable() == {B: 6}
    t.mark_committed({B: 6})
    assert t.committable() == {}
    t.done(A, 0, ea)
    assert t.committable() == {A: 1}


def test_committable_only_for_owned_partitions() -> None:
    t = OffsetTracker()
    ea, eb = t.track(A, 0), t.track(B, 0)
    t.done(A, 0, ea)
    t.done(B, 0, eb)
    assert t.committable(owned={B}) == {B: 1}


def test_gaps_in_offsets_are_fine() -> None:
    """Compacted topics and transaction markers leave gaps between offsets."""
    t = OffsetTracker()
    e = t.track(A, 3)
    t.track(A, 7)
    t.done(A, 7, e)
    t.done(A, 3, e)
    assert t.committable() == {A: 8}


def test_forgotten_partition_ignores_stale_results_even_after_reassignment() -> None:
    t = OffsetTracker()
    old = t.track(A, 0, 5)
    assert t.owns(A, 0, old)
    t.forget([A])
    assert not t.owns(A, 0, old) and t.in_flight_bytes == 0
    new = t.track(A, 0)  # reassigned: the same offset is read again
    assert new != old
    t.done(A, 0, old)  # the stale result of the first read
    assert t.committable() == {} and t.owns(A, 0, new)
    t.done(A, 0, new)
    assert t.committable() == {A: 1}


def test_offsets_moving_backwards_reset_the_partition() -> None:
    """A broker that lost its log starts offsets again at 0: a new epoch, not a crash."""
    t = OffsetTracker()
    old = t.track(A, 500, 7)
    t.track(A, 501, 7)
    new = t.track(A, 0, 3)
    assert new != old and t.resets == 1
    assert t.in_flight(A) == 1 and t.in_flight_bytes == 3
    t.done(A, 500, old)
    t.done(A, 0, new)
    assert t.committable() == {A: 1}


@given(st.permutations(list(range(30))), st.integers(min_value=0, max_value=30))
def test_watermark_is_first_not_done(order: list[int], n_done: int) -> None:
    t = OffsetTracker()
    epochs = [t.track(A, off, 1) for off in range(30)]
    done = set(order[:n_done])
    for off in order[:n_done]:
        t.done(A, off, epochs[off])
    first_missing = next((o for o in range(30) if o not in done), 30)
    expected = {A: first_missing} if first_missing > 0 else {}
    assert t.committable() == expected
    assert t.in_flight(A) == 30 - first_missing
    assert t.in_flight_bytes == 30 - n_done


def test_backpressure_pauses_at_the_bound_and_resumes_at_half() -> None:
    bp = Backpressure(max_records=100, max_bytes=1000)
    assert bp.update(99, 0) is None
    assert bp.update(100, 0) == "pause"
    assert bp.update(100, 0) is None  # already paused
    assert bp.update(51, 0) is None  # hysteresis
    assert bp.update(50, 0) == "resume"
    assert bp.update(0, 1000) == "pause"  # bytes alone trigger it too
    assert bp.update(0, 600) is None
    assert bp.update(0, 500) == "resume"


def test_failure_budget_consecutive_and_ratio() -> None:
    b = FailureBudget(max_consecutive=3, max_ratio=1.0, window=10)
    assert b.record(True) is None and b.record(True) is None
    assert b.record(False) is None  # the run is broken
    assert b.record(True) is None and b.record(True) is None
    reason = b.record(True)
    assert reason is not None and "consecutive" in reason

    r = FailureBudget(max_consecutive=0, max_ratio=0.5, window=4)
    assert [r.record(x) for x in (True, False, True)] == [None, None, None]  # window not full
    assert r.record(False) is None  # 2/4 is not above 0.5
    reason = r.record(True)  # window: F T F T -> still 2/4
    assert reason is None
    assert r.record(True) is not None  # T F T T -> 3/4


@settings(max_examples=300)
@given(
    st.integers(0, 4),
    st.sampled_from([0.0, 0.3, 0.5, 0.9]),
    st.integers(1, 12),
    # Batches without a failure (counted at once) among those with some.
    st.lists(
        st.lists(st.just(False), max_size=20) | st.lists(st.booleans(), max_size=20), max_size=12
    ),
)
def test_a_batch_counted_at_once_is_counted_as_its_records_one_by_one(
    consecutive: int, ratio: float, window: int, batches: list[list[bool]]
) -> None:
    """``record_all`` (per batch, all-ok batches at once) trips at the same record,
    for the same reason, and leaves the same counts as ``record`` per record."""
    whole = FailureBudget(consecutive, ratio, window)
    each = FailureBudget(consecutive, ratio, window)
    for batch in batches:
        want = None
        for i, failed in enumerate(batch):
            reason = each.record(failed)
            if reason is not None:
                want = (i, reason)
                break
        assert whole.record_all(batch) == want
        if want is not None:
            return
        assert (whole._failures, whole.consecutive, list(whole._recent)) == (
            each._failures, each.consecutive, list(each._recent))  # fmt: skip


def test_watermarks_with_previews_without_marking_and_reports_gaps() -> None:
    """What the exactly-once sink commits with a transaction: the watermark were
    its answers done, and whether all of them would be below it."""
    t = OffsetTracker()
    e = {off: t.track(A, off) for off in range(4)}
    eb = t.track(B, 7)
    later = [(A, 2, e[2]), (A, 3, e[3])]
    assert t.watermarks_with(later) == ({}, False)  # 0 and 1 unanswered: a gap
    assert t.watermarks_with([(A, 0, e[0]), *later]) == ({A: 1}, False)
    assert t.watermarks_with([(A, o, e[o]) for o in range(4)] + [(B, 7, eb)]) == (
        {A: 4, B: 8},
        True,
    )
    assert t.committable() == {} and t.in_flight() == 5  # nothing was marked
    stale = t.track(A, 0)  # offsets went backwards: a reset, a new epoch
    assert t.watermarks_with(later) == ({}, True)  # the old epoch's answers count for nothing
    assert t.watermarks_with([(A, 0, stale)]) == ({A: 1}, True)


def test_an_offset_read_again_while_the_log_reaches_past_it_is_a_redelivery() -> None:
    """Issue 35: a second delivery of offsets already read in this epoch is told
    apart from a reset by the broker's log, not by the order of deliveries."""
    t = OffsetTracker()
    assert not t.redelivered(A, 7, highwater=100)  # nothing read yet
    epoch = t.track(A, 7)
    t.track(A, 8)
    assert t.redelivered(A, 7, highwater=100) and t.redelivered(A, 8, highwater=9)
    assert not t.redelivered(A, 9, highwater=100)  # the next one
    assert not t.redelivered(A, 0, highwater=3)  # the log ends below 9: a reset
    assert not t.redelivered(A, 7, highwater=None)  # unknown: answered again, not lost
    t.done(A, 7, epoch)
    t.done(A, 8, epoch)  # answered: nothing pending, the watermark remembers
    assert t.redelivered(A, 8, highwater=9) and not t.redelivered(A, 9, highwater=9)


def test_in_flight_by_group_counts_each_groups_records_and_bytes() -> None:
    t = OffsetTracker()
    a0, a1, b0 = TopicPartition("a", 0), TopicPartition("a", 1), TopicPartition("b", 0)
    epochs = {tp: t.track(tp, 0, 10) for tp in (a0, a1, b0)}
    t.track(a0, 1, 5)
    t.track(b0, 1, 7)
    group = {"a": 0, "b": 1}
    assert t.in_flight_by(lambda tp: group[tp.topic], 2) == [(3, 25), (2, 17)]
    t.done(b0, 1, epochs[b0])  # done above the watermark: no bytes, still a record in flight
    assert t.in_flight_by(lambda tp: group[tp.topic], 2) == [(3, 25), (2, 10)]
    t.forget([a0])
    assert t.in_flight_by(lambda tp: group[tp.topic], 2) == [(1, 10), (2, 10)]
    assert t.in_flight_bytes == 20
