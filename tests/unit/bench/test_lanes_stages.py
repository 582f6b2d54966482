"""``benchmarks.lanes``' split of an urgent request's time inside the worker."""

from __future__ import annotations

from benchmarks.lanes import _stages


def test_the_stages_split_the_total_and_after_is_what_the_engine_left() -> None:
    timings = [
        {"queue": 1000 * i, "preprocess": 500, "infer": 1500, "d2h": 0, "total": 1000 * i + 5000}
        for i in range(1, 101)
    ]
    stages = _stages(timings)
    assert stages["engine"] == [2.0, 2.0]
    assert stages["after"] == [3.0, 3.0]  # total - queue - engine, whatever the queue
    assert stages["queue"] == [50.5, 99.0]


def test_a_file_decode_counts_as_engine_time() -> None:
    stages = _stages([{"queue": 0, "decode": 4000, "preprocess": 0, "infer": 1000, "total": 6000}])
    assert stages == {"queue": [0.0, 0.0], "engine": [5.0, 5.0], "after": [1.0, 1.0]}


def test_the_device_copy_counts_as_engine_time() -> None:
    timing = {"queue": 1000, "preprocess": 500, "infer": 1500, "d2h": 1000, "total": 5000}
    stages = _stages([timing])
    assert stages == {"queue": [1.0, 1.0], "engine": [3.0, 3.0], "after": [1.0, 1.0]}
