"""The autoscaling signals' arithmetic (``worker.flow.drain``): each model's
backlog from its partitions' lag, a shared topic split by what was read from it,
the rate a model answers at while busy, and the seconds its backlog takes."""

from __future__ import annotations

import pytest

from worker.flow.drain import BusyRate, Shares, backlog_by_model, seconds_to_drain


def test_busy_rate_leaves_idle_gaps_out() -> None:
    rate = BusyRate()
    assert rate.sample(0.0) is None  # nothing answered: no rate, not 0
    rate.began(1.0)
    rate.ended(1.5, 50)  # 50 answers in 0.5 s busy
    rate.began(9.0)  # 7.5 s idle between: not the model's slowness
    rate.ended(9.5, 50)
    assert rate.sample(10.0) == pytest.approx(100.0)


def test_busy_rate_counts_overlapping_batches_once_in_time() -> None:
    """Two batches in flight together (two threads or slots): the answers of
    both over the wall time either was running, which is the throughput the
    model reaches with them, not one batch's rate times two."""
    rate = BusyRate()
    rate.began(0.0)
    rate.began(0.1)
    rate.ended(1.0, 64)
    rate.ended(1.1, 64)
    assert rate.sample(2.0) == pytest.approx(128 / 1.1)


def test_busy_rate_times_a_batch_still_in_flight_into_the_window() -> None:
    rate = BusyRate()
    rate.began(0.0)
    rate.ended(1.0, 10)
    rate.began(1.0)  # in flight across the poll: its first second counts now
    assert rate.sample(2.0) == pytest.approx(10 / 2.0)
    rate.ended(3.0, 30)  # the window after: from the poll at 2.0 to 3.0
    assert rate.sample(4.0) == pytest.approx(0.5 * 5.0 + 0.5 * 30.0)


def test_busy_rate_keeps_its_last_value_through_idle_polls() -> None:
    rate = BusyRate()
    rate.began(0.0)
    rate.ended(0.5, 100)
    assert rate.sample(1.0) == pytest.approx(200.0)
    assert rate.sample(6.0) == pytest.approx(200.0)  # idle: the rate a backlog would meet
    rate.began(6.0)
    rate.ended(6.5, 0)  # a failed batch: its time counted, no answers
    rate.began(6.5)
    rate.ended(7.0, 100)
    assert rate.sample(8.0) == pytest.approx(0.5 * 200.0 + 0.5 * 100.0)


def test_seconds_to_drain() -> None:
    assert seconds_to_drain(0, None) == 0.0  # no backlog: 0, measured or not
    assert seconds_to_drain(0, 50.0) == 0.0
    assert seconds_to_drain(10, None) is None  # a backlog and no rate: no number
    assert seconds_to_drain(10, 0.0) is None
    assert seconds_to_drain(100, 50.0) == pytest.approx(2.0)


def test_backlog_is_each_topic_s_owner_s_and_a_model_without_one_reads_0() -> None:
    owners = {"a.1": "a", "a.2": "a", "b": "b"}
    lags = [("a.1", 5), ("a.1", 7), ("a.2", 1), ("b", 0)]
    assert backlog_by_model(lags, owners.__getitem__, frozenset(), Shares()) == {"a": 13, "b": 0}
    assert backlog_by_model([], owners.__getitem__, frozenset(), Shares()) == {}


def test_a_shared_topic_is_split_by_what_was_read_from_it() -> None:
    owners = {"shared": "a", "b": "b"}
    shares = Shares()
    # Nothing read from it yet: all its owner's (the model answering requests naming none).
    assert backlog_by_model([("shared", 10)], owners.__getitem__, frozenset({"shared"}),
                            shares) == {"a": 10}  # fmt: skip
    for model in ["a"] * 1 + ["b"] * 2:
        shares.count("shared", model)
    split = backlog_by_model([("shared", 10), ("b", 4)], owners.__getitem__,
                             frozenset({"shared"}), shares)  # fmt: skip
    assert split == {"a": 3, "b": 7 + 4}  # whole records, adding up to the lag (10)


def test_shares_split_in_whole_records_that_add_up() -> None:
    shares = Shares()
    for model in "xyz":
        shares.count("t", model)
    parts = shares.split("t", 10, "x")
    assert sum(parts.values()) == 10 and sorted(parts.values()) == [3, 3, 4]
    assert shares.split("t", 0, "x") == {"x": 0, "y": 0, "z": 0}


def test_shares_forget_a_model_no_longer_read() -> None:
    shares = Shares()
    shares.count("t", "old")
    for _ in range(3):
        shares.decay()
        shares.count("t", "new")
    assert shares.split("t", 100, "old") == {"new": 100}
