"""The demo's pass/fail: it cannot pass with a figure that is impossible."""

from __future__ import annotations

from worker.bench.demo import RunStats, _problems


def passing() -> RunStats:
    return RunStats("worker", sent=10, received=10, correct=9, seconds=1.0, throughput=10.0,
                    p50_ms=5.0, min_ms=1.0, max_ms=9.0, committed=10, worker_exit=0)  # fmt: skip


def test_a_run_with_every_answer_passes() -> None:
    assert _problems(passing(), offline=9) == []


def test_a_negative_latency_fails_the_demo() -> None:
    s = passing()
    s.min_ms = -1394.1
    assert _problems(s, offline=9) == ["a negative time (results matched to the wrong requests)"]


def test_each_shortfall_is_named() -> None:
    s = passing()
    s.received, s.committed, s.worker_exit = 9, 8, 1
    assert _problems(s, offline=8) == [
        "9 of 10 answered", "accuracy 9 correct, offline 8", "8 of 10 offsets committed",
        "process exit 1",
    ]  # fmt: skip
