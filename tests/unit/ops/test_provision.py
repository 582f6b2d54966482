"""``infer-worker topics``: the topics a configuration needs (worker.ops.provision),
each with the setting that names it and how it is made; what is wrong with one
that exists."""

from __future__ import annotations

import dataclasses

from worker.config import (
    KafkaConfig,
    LimitsConfig,
    ModelConfig,
    PipelineConfig,
    Settings,
    StepConfig,
    load_settings,
)
from worker.config.kafka import LaneConfig
from worker.config.topics import COMPACTED, NeededTopic
from worker.ops.provision import Found, needed, report


def test_every_topic_the_worker_reads_or_writes_is_needed() -> None:
    k = KafkaConfig(input_topics=("u", "b"), lanes=(LaneConfig(("u",)), LaneConfig(("b",), 1)),
                    output_topic="out", dlq_topic="dlq", crash_guard_topic="guard")  # fmt: skip
    got = {(t.name, t.setting, t.partitions, tuple(t.configs.items())) for t in needed(
        Settings(kafka=k), partitions=4)}  # fmt: skip
    assert got == {
        ("u", "kafka.input_topics", 4, ()), ("b", "kafka.input_topics", 4, ()),
        ("out", "kafka.output_topic", 4, ()), ("dlq", "kafka.dlq_topic", 1, ()),
        ("guard", "kafka.crash_guard_topic", 1, (("cleanup.policy", "compact"),)),
    }  # fmt: skip


def test_a_shadow_a_stateful_model_and_protection_off_need_what_they_use() -> None:
    shadow = Settings(kafka=KafkaConfig(output_topic="out.shadow", shadow=True))
    assert [t.name for t in needed(shadow)] == ["infer.requests", "out.shadow"]
    stateful = Settings(kafka=KafkaConfig(state_topic="st"),
                        limits=LimitsConfig(max_crash_attempts=0))  # fmt: skip
    names = {t.name: t for t in needed(stateful)}
    assert set(names) == {"infer.requests", "infer.results", "infer.dlq", "st"}
    assert names["st"].partitions is None and names["st"].configs == COMPACTED


def test_a_pipeline_step_s_topic_is_needed() -> None:
    steps = (StepConfig(name="d", model="digits", topic="audit.d"),
             StepConfig(name="e", model="digits"))  # fmt: skip
    s = Settings(kafka=KafkaConfig(input_topics=("a", "b")), model=ModelConfig(topics=("a",)),
                 pipelines={"chain": PipelineConfig(topics=("b",), steps=steps,
                                                    outputs={"x": "e.topk_indices"})})  # fmt: skip
    found = {t.name: (t.setting, t.partitions) for t in needed(s, partitions=3)}
    assert found["audit.d"] == ("pipelines.chain.steps[0].topic", 3)
    assert len([t for t in found if t.startswith("audit")]) == 1


def test_what_is_wrong_with_an_existing_topic_is_named() -> None:
    state = NeededTopic("st", "kafka.state_topic", None, dict(COMPACTED), co_partitioned="in")
    fine = Found(state, 4, {"cleanup.policy": "compact"})
    wrong = Found(state, 2, {"cleanup.policy": "delete"})
    absent = Found(dataclasses.replace(state, name="gone"), 0, {})
    inputs = Found(NeededTopic("in", "kafka.input_topics", 6), 4, {})
    assert fine.problems(4) == [] and absent.problems(4) == []
    assert wrong.problems(4) == [
        "cleanup.policy is delete, needs compact",
        "2 partitions, in 4 (they must be equal: co-partitioned)",
    ]
    lines = report([inputs, fine, wrong, absent])
    assert lines[0].split() == ["in", "kafka.input_topics", "4", "partitions"]
    assert lines[3].split()[-1] == "MISSING" and "co-partitioned" in lines[2]


def test_each_model_s_changelog_is_co_partitioned_with_its_own_topic() -> None:
    """Beside other models a stateful model's changelog goes with its own topic,
    not the first input topic (topics create sizes it, topics check holds it)."""
    s = load_settings(env={
        "INFER_WORKER_KAFKA__INPUT_TOPICS": "scores,audio",
        "INFER_WORKER_MODELS__SCORER__PATH": "builtin:digits",
        "INFER_WORKER_MODELS__SCORER__TOPICS": "scores",
        "INFER_WORKER_MODELS__VAD__PATH": "vad.onnx",
        "INFER_WORKER_MODELS__VAD__TOPICS": "audio",
        "INFER_WORKER_MODELS__VAD__STATE_TOPIC": "audio.states",
    })  # fmt: skip
    (state,) = [t for t in needed(s) if t.name == "audio.states"]
    assert (state.setting, state.co_partitioned, state.configs) == (
        "models.vad.state_topic", "audio", COMPACTED)
    found = [Found(NeededTopic("scores", "kafka.input_topics", 6), 6, {}),
             Found(NeededTopic("audio", "kafka.input_topics", 6), 2, {}),
             Found(state, 6, dict(COMPACTED))]  # fmt: skip
    assert "6 partitions, audio 2 (they must be equal: co-partitioned)" in report(found)[2]
