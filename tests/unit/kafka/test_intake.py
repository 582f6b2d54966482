"""Intake: a record becomes a Job; deadlines from both rules, the earlier wins;
the model a request names decides whose inputs it is checked against."""

from __future__ import annotations

import time

import numpy as np

from tests.models import model_inputs
from worker.config import LimitsConfig, ModelConfig
from worker.config.models import Routing
from worker.contract import ModelRef, Request, Tensor, encode_request
from worker.kafka.intake import JobFactory


def _value(deadline_ms: int | None = None, model: ModelRef | None = None) -> bytes:
    img = Tensor.from_numpy(np.zeros((8, 8, 1), np.uint8))
    return encode_request(
        Request(v=1, id="r", inputs={"image": img}, deadline_ms=deadline_ms, model=model)
    )


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


def _two_models() -> JobFactory:
    """[model] (digits, an image) on topic ``t``, shared with a text model whose
    own topic is ``s``: one intake, its answerer decided by the routing table."""
    text = model_inputs(ModelConfig(name="sentiment", path="builtin:sentiment"))
    table = Routing({"t": "digits", "s": "sentiment"}, frozenset({"t"}), ("digits", "sentiment"))
    return JobFactory(model_inputs(), LimitsConfig(), model="digits", routing=table,
                      others={"sentiment": (text, LimitsConfig())})  # fmt: skip


def test_a_request_on_a_shared_topic_goes_to_the_model_it_names() -> None:
    digits = _two_models()
    named = Request(v=1, id="t", inputs={"text": "fine"}, model=ModelRef("sentiment"))
    job = digits("t", 0, 1, None, encode_request(named))
    assert job.failure is None and job.model == "sentiment" and job.inputs["text"] == "fine"
    plain = digits("t", 0, 2, None, _value())
    assert plain.failure is None and plain.model == "digits"
    # Checked against the named model's inputs: an image is not what the text model takes.
    wrong = digits("t", 0, 3, None, _value(model=ModelRef("sentiment")))
    assert wrong.model == "sentiment" and wrong.failure is not None
    assert str(wrong.failure) == "inputs.image: unknown input; the model takes text"


def test_a_model_not_served_is_answered_unknown_model_naming_those_served() -> None:
    intake = _two_models()
    for topic, owner in (("t", "digits"), ("s", "sentiment")):
        job = intake(topic, 0, 1, None, _value(model=ModelRef("translator")))
        assert job.failure is not None and job.failure.code == "unknown_model"
        assert str(job.failure) == (
            "model: 'translator' is not served here; this worker serves 'digits', 'sentiment'"
        )
        assert job.model == owner  # answered by its topic's model, id echoed
        assert getattr(job.failure, "request_id", None) == "r"


def test_a_model_s_own_topic_answers_that_model_only() -> None:
    job = _two_models()("s", 0, 1, None, _value(model=ModelRef("digits")))
    assert job.failure is not None and job.failure.code == "invalid_request"
    assert "carries 'sentiment''s requests only" in str(job.failure)
    alone = JobFactory(model_inputs(), LimitsConfig(), model="digits")  # one model
    assert alone("t", 0, 1, None, _value(model=ModelRef("digits"))).failure is None
    other = alone("t", 0, 2, None, _value(model=ModelRef("mnist")))
    assert other.failure is not None and other.failure.code == "unknown_model"
