"""The crash guard's rule (pure): what a new owner does given the mark it finds."""

from __future__ import annotations

import pytest

from worker.kafka.crashguard import Mark, Mode, decide


@pytest.mark.parametrize(
    ("previous", "head", "crashes", "mode"),
    [
        (None, 0, 0, Mode.BATCHED),  # first owner ever
        (Mark(5, 0), 9, 0, Mode.BATCHED),  # released cleanly: no crash
        (Mark(5, 0), 5, 0, Mode.BATCHED),  # released at the same head: still none
        (Mark(5, 1), 5, 1, Mode.ONE_BY_ONE),  # its owner died at this head
        (Mark(5, 1), 9, 1, Mode.ONE_BY_ONE),  # died after committing up to 9
        (Mark(9, 2), 9, 2, Mode.ONE_BY_ONE),
        (Mark(9, 3), 9, 3, Mode.QUARANTINE),  # the third death here: quarantine
        (Mark(9, 7), 9, 7, Mode.QUARANTINE),
    ],
)
def test_decide(previous: Mark | None, head: int, crashes: int, mode: Mode) -> None:
    d = decide(previous, head, max_crashes=3)
    assert (d.crashes, d.mode) == (crashes, mode)
    if mode is Mode.ONE_BY_ONE:
        # Counts itself only once it hands the head record on to run.
        assert (d.claims, d.armed) == (crashes, crashes + 1)
    else:
        assert d.claims == crashes + 1 and d.armed is None


def test_cautious_owners_that_die_before_running_the_head_do_not_quarantine_it() -> None:
    """Killed three times while cautious but before the head record was handed on
    (a restart loop under load): the mark never grows, the record is never set
    aside. Three deaths with it running: quarantined, as before."""
    mark = Mark(7, 1)  # a batched owner died at head 7
    for _ in range(5):
        d = decide(mark, 7, max_crashes=3)
        assert d.mode is Mode.ONE_BY_ONE
        mark = Mark(7, d.claims)  # claimed, then killed before the head ran
    assert mark == Mark(7, 1)
    for _ in range(2):  # now each owner runs the head record and dies
        d = decide(mark, 7, max_crashes=3)
        assert d.armed is not None
        mark = Mark(7, d.armed)
    assert decide(mark, 7, max_crashes=3).mode is Mode.QUARANTINE


def test_zero_disables_quarantine_but_not_caution() -> None:
    assert decide(Mark(1, 10), 1, max_crashes=0).mode is Mode.ONE_BY_ONE
