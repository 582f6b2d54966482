"""Intake: a record becomes a Job; deadlines from both rules, the earlier wins."""

from __future__ import annotations

import time

import numpy as np

from tests.models import model_inputs
from worker.config import LimitsConfig
from worker.contract import Request, Tensor, encode_request
from worker.kafka.intake import JobFactory


def _value(deadline_ms: int | None = None) -> bytes:
    img = Tensor.from_numpy(np.zeros((8, 8, 1), np.uint8))
    return encode_request(Request(v=1, id="r", inputs={"image": img}, deadline_ms=deadline_ms))


def test_record_age_is_off_by_default() -> None:
    make = JobFactory(model_inputs(), LimitsConfig())
    job = make("t", 0, 1, None, _value(), timestamp_ms=0)  # 1970: ancient
    assert job.failure is None and job.deadline is None and job.expiry is None


def test_record_age_sets_the_deadline_from_the_kafka_timestamp() -> None:
    make = JobFactory(model_inputs(), LimitsConfig(), max_record_age_ms=1000)
    now_ms = int(time.time() * 1000)
    job = make("t", 0, 1, None, _value(), timestamp_ms=now_ms - 5000)
    assert job.expiry == "max_record_age"
    assert job.deadline is not None and job.deadline < time.monotonic()  # already stale
    fresh = make("t", 0, 2, None, _value(), timestamp_ms=now_ms)
    assert fresh.deadline is not None and fresh.deadline > time.monotonic() + 0.5


def test_the_earlier_of_deadline_ms_and_record_age_wins() -> None:
    make = JobFactory(model_inputs(), LimitsConfig(), max_record_age_ms=60_000)
    now_ms = int(time.time() * 1000)
    soon = make("t", 0, 1, None, _value(deadline_ms=now_ms + 100), timestamp_ms=now_ms)
    assert soon.expiry == "deadline_ms"
    late = make("t", 0, 2, None, _value(deadline_ms=now_ms + 3_600_000), timestamp_ms=now_ms)
    assert late.expiry == "max_record_age"
    assert soon.deadline is not None and late.deadline is not None
    assert soon.deadline < late.deadline
