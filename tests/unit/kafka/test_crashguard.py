"""The crash guard's rule (pure): what a new owner does given the mark it finds."""

from __future__ import annotations

import pytest

from worker.kafka.crashguard import Mark, decide


@pytest.mark.parametrize(
    ("previous", "head", "crashes", "cautious", "quarantine"),
    [
        (None, 0, 0, False, False),  # first owner ever
        (Mark(5, 0), 9, 0, False, False),  # released cleanly: no crash
        (Mark(5, 0), 5, 0, False, False),  # released at the same head: still none
        (Mark(5, 1), 5, 1, True, False),  # its owner died at this head
        (Mark(5, 1), 9, 1, True, False),  # died after committing up to 9
        (Mark(9, 2), 9, 2, True, False),
        (Mark(9, 3), 9, 3, True, True),  # the third death here: quarantine
        (Mark(9, 7), 9, 7, True, True),
    ],
)
def test_decide(
    previous: Mark | None, head: int, crashes: int, cautious: bool, quarantine: bool
) -> None:
    d = decide(previous, head, max_crashes=3)
    assert (d.crashes, d.cautious, d.quarantine) == (crashes, cautious, quarantine)
    assert d.claims == crashes + 1  # this owner counts itself until it releases


def test_zero_disables_quarantine_but_not_caution() -> None:
    d = decide(Mark(1, 10), 1, max_crashes=0)
    assert d.cautious and not d.quarantine
