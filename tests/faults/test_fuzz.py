"""A seeded corpus of mutated requests through a real worker (issue 10; the
100,000-payload run is ``benchmarks/fuzz.py``, figures in BENCHMARKS.md): every
payload answered, by the same process, in bounded memory."""

from __future__ import annotations

from benchmarks.fuzz import run


async def test_mutated_records_and_image_files_are_all_answered_without_a_crash() -> None:
    outcome = await run(n=1500, seed=7)
    assert outcome.worker_exit_during_run is None
    assert outcome.answered == outcome.sent == 1500
    classes = outcome.classes
    assert classes.get("ok", 0) > 0 and classes.get("dlq undecodable", 0) > 0
    assert classes.get("error invalid_request", 0) > 0
    assert (
        outcome.kinds.get("mutated jpeg file", 0) > 0
        and outcome.kinds.get("mutated png file", 0) > 0
    )
    assert outcome.peak_rss_mib < 400
