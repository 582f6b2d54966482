"""``[models.NAME]``: several models in one worker, routed by input topic or by the
request. Every input topic is answered by exactly one model or pipeline, every
model is one kind of value whatever section configured it, and every mistake is
refused with the key as the user wrote it."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.app.plan import RunPlan
from worker.config import Settings, load_settings
from worker.config.models import Routing, as_served, routing, served
from worker.flow.errors import ConfigError, InvalidRequest, UnknownModel

TWO = """
[kafka]
input_topics = ["digits.requests", "reviews.requests", "more.reviews"]
[model]
path = "builtin:digits"
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
    default, sentiment = (m.settings for m in served(s))
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
        ({"INFER_WORKER_MODEL__TOPICS": "digits.requests,more.reviews"},
         "models.sentiment.topics: 'more.reviews' is also model's: a topic belongs to one model"),
        ({"INFER_WORKER_MODELS__SENTIMENT__TOPICS":
          "digits.requests,reviews.requests,more.reviews"},
         "model.topics: [model] answers no input topic"),
        ({"INFER_WORKER_MODEL__TOPICS": "digits.requests",
          "INFER_WORKER_MODELS__SENTIMENT__TOPICS": "reviews.requests"},
         "kafka.input_topics: ['more.reviews'] answered by no model or pipeline"),
        ({"INFER_WORKER_MODEL__NAME": "sentiment"},
         "model.name: 'sentiment' is also a [models.NAME]"),
        ({"INFER_WORKER_MODELS__SENTIMENT__NAME": "reviews"},
         "models.sentiment.name: 'reviews': a [models.NAME] model is named by its table"),
        ({"INFER_WORKER_MODELS__SENTIMENT__INTRA_OP_THREADS": "-1"},
         "models.sentiment.intra_op_threads: must be >= 0"),
        ({"INFER_WORKER_MODELS__SENTIMENT__BACKEND": "gpu-twin",
          "INFER_WORKER_MODEL__BACKEND": "tensorrt"},
         "models.sentiment.backend: 'gpu-twin' beside tensorrt or torch"),
        ({"INFER_WORKER_KAFKA__STATE_TOPIC": "states"},
         "kafka.state_topic: with several models, name each stateful model's changelog"),
        ({"INFER_WORKER_MODELS__SENTIMENT__STATE_TOPIC": "states"},
         "models.sentiment.state_topic: durable states need the model's one input topic"),
    ],
)  # fmt: skip
def test_refused_with_the_key_as_written(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, TWO, env)
    assert message in str(refused.value)


def test_lanes_with_several_models_rank_each_model_s_lanes(tmp_path: Path) -> None:
    """Priority lanes beside several models (refused before): one pause decision
    per (model, lane), each on its model's counts, the urgent lane's bounds the
    higher; a lane in a process of its own is still refused, naming it."""
    from worker.app.lanes import backpressure

    lanes = '\n[[kafka.lanes]]\ntopics = ["digits.requests", "reviews.requests"]\n' \
            'priority = 0\n[[kafka.lanes]]\ntopics = ["more.reviews"]\npriority = 1\n'
    s = _load(tmp_path, TWO + lanes)
    models = [m.settings for m in served(s)]
    owners = {"digits.requests": 0, "reviews.requests": 1, "more.reviews": 1}
    bp, ranks = backpressure(s, models, owners)
    assert ranks == {"digits.requests": 0, "reviews.requests": 1, "more.reviews": 2}
    assert bp.labels == ["digits/digits.requests", "sentiment/digits.requests",
                         "sentiment/more.reviews"]  # fmt: skip
    assert [lane.max_records for lane in bp.lanes] == [384, 384, 256]  # urgent: 1.5x
    # Sentiment's two lanes decide on its whole count: 300 in flight pauses its bulk
    # lane (bound 256) and not its urgent one (384); digits' is its own.
    changes = bp.update_each([(0, 0), (100, 0), (200, 0)])
    assert changes == [(2, "pause")] and not bp.is_paused(1) and not bp.is_paused(0)
    own = lanes.replace("priority = 1\n", "priority = 1\nown_process = true\n")
    with pytest.raises(ConfigError, match=r"kafka\.lanes\[1\]\.own_process: a lane in a "
                       r"process of its own"):  # fmt: skip
        _load(tmp_path, TWO + own)


def test_one_models_topics_must_cover_the_input_topics(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.topics: \['b'\] in kafka.input_topics but "):
        _load(tmp_path, '[kafka]\ninput_topics = ["a", "b"]\n[model]\ntopics = ["a"]\n')


ONLY_MODELS = """
[kafka]
input_topics = ["scores", "texts"]
[models.scorer]
path = "builtin:digits"
topics = ["scores"]
[models.reader]
path = "builtin:sentiment"
topics = ["texts"]
"""


def test_models_sections_alone_are_a_complete_configuration(tmp_path: Path) -> None:
    s = _load(tmp_path, ONLY_MODELS)
    assert [(m.name, m.key, m.topics) for m in served(s)] == [
        ("scorer", "models.scorer", ("scores",)), ("reader", "models.reader", ("texts",))]
    assert routing(s).owners == {"scores": "scorer", "texts": "reader"}
    assert routing(s).names == ("scorer", "reader")  # no bundled model appears


def test_a_topic_no_model_names_is_refused_never_given_the_bundled_model(
    tmp_path: Path,
) -> None:
    text = ONLY_MODELS.replace('"texts"]\n[models', '"texts", "third"]\n[models', 1)
    with pytest.raises(ConfigError, match=r"kafka.input_topics: \['third'\] answered by no "
                       r"model or pipeline"):  # fmt: skip
        _load(tmp_path, text)


def test_one_models_section_answers_every_topic_and_has_what_one_model_has(
    tmp_path: Path,
) -> None:
    s = _load(tmp_path, '[kafka]\ninput_topics = ["a", "b"]\n[models.scorer]\n'
              'path = "builtin:digits"\nreload_interval_s = 5\n')  # refused beside others
    (only,) = served(s)
    assert (only.name, only.topics) == ("scorer", ("a", "b"))
    assert only.settings.model.name == "scorer" and only.settings.model.reload_interval_s == 5
    # Run as one model: its settings alone, the plan decided on it (refused beside others).
    assert as_served(s) == only.settings and RunPlan.of(s).reloads
    gpu = _load(tmp_path, '[models.scorer]\npath = "m.pt"\nbackend = "torch"\n')
    assert RunPlan.of(gpu).device == "gpu" and as_served(gpu).model.backend == "torch"


def test_model_with_its_topics_beside_a_pipelines_model(tmp_path: Path) -> None:
    """models.md's form: [model] with topics of its own beside a [models.NAME] a
    pipeline runs. Its settings as it runs alone keep no topics of their own, so
    they pass the one-model check (it failed at start-up: 'model.topics:
    ['combiner.requests'] in kafka.input_topics but served by no model')."""
    s = _load(tmp_path, """
[kafka]
input_topics = ["digits.requests", "combiner.requests"]
[model]
topics = ["digits.requests"]
[models.combiner]
path = "builtin:digits"
topics = ["combiner.requests"]
""")
    default, combiner = served(s)
    assert default.topics == ("digits.requests",) and default.settings.model.topics == ()
    assert combiner.settings.model.name == "combiner"
    for m in served(s):
        assert served(m.settings)[0].topics == s.kafka.input_topics  # alone: every topic


def test_the_routing_table_decides_every_answerer() -> None:
    table = Routing({"shared": "digits", "own": "sentiment"}, frozenset({"shared"}),
                    ("digits", "sentiment", "quiet"))  # fmt: skip
    assert table.answerer("shared", None) == "digits"
    assert table.answerer("shared", "quiet") == "quiet"  # a model with no topic of its own
    assert table.answerer("own", "sentiment") == "sentiment"
    with pytest.raises(InvalidRequest, match=r"carries .sentiment..s requests only"):
        table.answerer("own", "digits", request_id="r1")
    with pytest.raises(UnknownModel, match="'nope' is not served here") as unknown:
        table.answerer("shared", "nope", request_id="r2")
    assert unknown.value.request_id == "r2"
    assert table.answerers == ("digits", "sentiment", "quiet")


def test_a_model_without_topics_is_named_on_the_shared_topics(tmp_path: Path) -> None:
    s = _load(tmp_path, '[kafka]\ninput_topics = ["a"]\n[model]\npath = "builtin:digits"\n'
              '[models.sentiment]\npath = "builtin:sentiment"\n')
    table = routing(s)
    assert table.owners == {"a": "digits"} and table.answerer("a", "sentiment") == "sentiment"


def test_without_a_shared_topic_a_model_must_answer_something(tmp_path: Path) -> None:
    text = ONLY_MODELS + '[models.idle]\npath = "builtin:digits"\n'
    with pytest.raises(ConfigError, match=r"models\.idle\.topics: names the input topics"):
        _load(tmp_path, text)


def test_a_model_beside_others_may_be_swapped_while_serving_unless_a_pipeline_runs_it(
    tmp_path: Path,
) -> None:
    s = _load(tmp_path, TWO + "reload_interval_s = 5\n")  # [models.sentiment]'s
    assert RunPlan.of(s).reloads
    text = """
[kafka]
input_topics = ["digits.requests", "reviews.requests"]
[model]
path = "builtin:digits"
topics = ["digits.requests"]
[models.sentiment]
path = "builtin:sentiment"
reload_interval_s = 5
[pipelines.chain]
topics = ["reviews.requests"]
outputs = { x = "s.logits" }
[[pipelines.chain.steps]]
name = "s"
model = "sentiment"
"""
    with pytest.raises(ConfigError, match=r"models\.sentiment\.reload_interval_s: a model a "
                       r"pipeline runs is not swapped"):  # fmt: skip
        _load(tmp_path, text)


def test_each_stateful_model_keeps_a_changelog_of_its_own(tmp_path: Path) -> None:
    """Durable states beside other models (refused before: 'durable states need a
    worker of one model'): the model's settings as it runs carry its changelog, and
    requests on the shared topic may not name it (its states live with its topic)."""
    s = _load(tmp_path, TWO, {"INFER_WORKER_MODELS__SENTIMENT__TOPICS": "reviews.requests",
                              "INFER_WORKER_MODEL__TOPICS": "digits.requests,more.reviews",
                              "INFER_WORKER_MODELS__SENTIMENT__STATE_TOPIC": "reviews.states"})
    default, sentiment = served(s)
    assert sentiment.settings.kafka.state_topic == "reviews.states"
    assert default.settings.kafka.state_topic == "" and not s.kafka.state_topic
    table = routing(s)
    assert table.answerer("reviews.requests", "sentiment") == "sentiment"
    with pytest.raises(InvalidRequest, match="carries 'digits'"):
        table.answerer("digits.requests", "sentiment")
    one = _load(tmp_path, '[models.vad]\npath = "x.onnx"\nstate_topic = "vad.states"\n')
    assert as_served(one).kafka.state_topic == "vad.states"  # one model: kafka.state_topic


def test_two_models_never_share_a_changelog(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"models\.b\.state_topic: 'states' is also "
                       r"models\.a\.state_topic's"):  # fmt: skip
        _load(tmp_path, '[kafka]\ninput_topics = ["x", "y"]\n[models.a]\npath = "a.onnx"\n'
              'topics = ["x"]\nstate_topic = "states"\n[models.b]\npath = "b.onnx"\n'
              'topics = ["y"]\nstate_topic = "states"\n')
