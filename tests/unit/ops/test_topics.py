"""The harness's reader must not skip records the embedded broker shows late."""

from __future__ import annotations

from worker.ops.topics import OffsetGaps


def test_reader_rereads_a_gap_until_it_fills() -> None:
    """Tansu, with several producers appending to one partition at once, can show
    a later batch before an earlier one; a tailing reader then jumped past the
    earlier records for good (a worker's answers reported as lost)."""
    g = OffsetGaps(patience=5.0)
    g.start("p", 0)
    assert g.check("p", 0, now=0.0) == "take"
    assert g.check("p", 3, now=1.0) == "reread" and g.expected("p") == 1
    assert g.check("p", 3, now=2.0) == "reread"  # still not visible: read it again
    assert [g.check("p", o, now=2.5) for o in (1, 2, 3)] == ["take"] * 3
    assert g.check("p", 2, now=3.0) == "skip"  # already taken


def test_reader_accepts_a_gap_that_stays() -> None:
    """Compaction and transaction markers leave real gaps on a Kafka broker."""
    g = OffsetGaps(patience=5.0)
    g.start("p", 10)
    assert g.check("p", 12, now=0.0) == "reread"
    assert g.check("p", 12, now=4.9) == "reread"
    assert g.check("p", 12, now=5.0) == "take" and g.expected("p") == 13
    assert g.check("q", 7, now=5.0) == "take"  # a partition never started: no gap known
