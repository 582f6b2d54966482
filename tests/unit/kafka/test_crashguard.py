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
    assert d.claims == crashes + 1  # this owner counts itself until it releases


def test_zero_disables_quarantine_but_not_caution() -> None:
    assert decide(Mark(1, 10), 1, max_crashes=0).mode is Mode.ONE_BY_ONE
