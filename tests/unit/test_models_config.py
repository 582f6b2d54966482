"""``[models.NAME]``: several models in one worker, routed by input topic. Every
input topic is answered by exactly one model, and every mistake is refused with
the key as the user wrote it."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.config import Settings, load_settings
from worker.config.models import named, served
from worker.flow.errors import ConfigError

TWO = """
[kafka]
input_topics = ["digits.requests", "reviews.requests", "more.reviews"]
[models.sentiment]
path = "builtin:sentiment"
topics = ["reviews.requests", "more.reviews"]
"""


def _load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Settings:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return load_settings(path, env=env or {})


def test_model_answers_the_topics_no_other_model_names(tmp_path: Path) -> None:
    s = _load(tmp_path, TWO)
    assert [(m.key, m.topics) for m in served(s)] == [
        ("model", ("digits.requests",)),
        ("models.sentiment", ("reviews.requests", "more.reviews")),
    ]
    (_, default), (_, sentiment) = named(s)
    assert (default.model.name, sentiment.model.name) == ("digits", "sentiment")
    assert sentiment.model.path == "builtin:sentiment" and not sentiment.models
    assert default.kafka == sentiment.kafka == s.kafka  # one consumer for all


def test_one_model_configurations_are_unchanged(tmp_path: Path) -> None:
    s = _load(tmp_path, '[kafka]\ninput_topics = ["a", "b"]\n')
    assert not s.models and served(s)[0].topics == ("a", "b")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"INFER_WORKER_MODELS__SENTIMENT__TOPICS": "elsewhere"},
         "models.sentiment.topics: ['elsewhere'] not in kafka.input_topics"),
        ({"INFER_WORKER_MODELS__SENTIMENT__TOPICS": ""},
         "models.sentiment.topics: names the input topics this model answers"),
        ({"INFER_WORKER_MODEL__TOPICS": "digits.requests,more.reviews"},
         "models.sentiment.topics: 'more.reviews' is also model's: a topic belongs to one model"),
        ({"INFER_WORKER_MODELS__SENTIMENT__TOPICS":
          "digits.requests,reviews.requests,more.reviews"},
         "model.topics: [model] answers no input topic"),
        ({"INFER_WORKER_MODEL__TOPICS": "digits.requests",
          "INFER_WORKER_MODELS__SENTIMENT__TOPICS": "reviews.requests"},
         "kafka.input_topics: ['more.reviews'] answered by no model"),
        ({"INFER_WORKER_MODEL__NAME": "sentiment"},
         "model.name: 'sentiment' is also a [models.NAME]"),
        ({"INFER_WORKER_MODELS__SENTIMENT__NAME": "reviews"},
         "models.sentiment.name: 'reviews': a [models.NAME] model is named by its table"),
        ({"INFER_WORKER_MODELS__SENTIMENT__INTRA_OP_THREADS": "-1"},
         "models.sentiment.intra_op_threads: must be >= 0"),
        ({"INFER_WORKER_MODELS__SENTIMENT__BACKEND": "torch"},
         "models.sentiment.backend: 'torch': several models in one worker run on the CPU path"),
        ({"INFER_WORKER_MODELS__SENTIMENT__RELOAD_INTERVAL_S": "5"},
         "models.sentiment.reload_interval_s: a model swapped while serving is served alone"),
        ({"INFER_WORKER_KAFKA__STATE_TOPIC": "states"},
         "kafka.state_topic: durable states need a worker of one model and one input topic"),
    ],
)  # fmt: skip
def test_refused_with_the_key_as_written(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, TWO, env)
    assert message in str(refused.value)


def test_lanes_and_several_models_are_refused(tmp_path: Path) -> None:
    lanes = '\n[[kafka.lanes]]\ntopics = ["digits.requests"]\npriority = 0\n' \
            '[[kafka.lanes]]\ntopics = ["reviews.requests", "more.reviews"]\npriority = 1\n'
    with pytest.raises(ConfigError, match=r"kafka\.lanes: priority lanes and several models"):
        _load(tmp_path, TWO + lanes)


def test_one_models_topics_must_cover_the_input_topics(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.topics: \['b'\] in kafka.input_topics but "):
        _load(tmp_path, '[kafka]\ninput_topics = ["a", "b"]\n[model]\ntopics = ["a"]\n')
