"""The topics a configuration names, checked in its words (worker.kafka.topiccheck):
a missing topic names the setting and what exists; a topic gone while serving is
one log line per topic naming its setting, not one per refused record."""

from __future__ import annotations

import pytest
import structlog
from aiokafka.errors import KafkaTimeoutError, UnknownTopicOrPartitionError

from worker.config import KafkaConfig
from worker.flow.errors import ConfigError
from worker.kafka.topiccheck import MissingTopics, missing, require_topics


def test_missing_topics_are_named_with_the_setting_and_what_exists() -> None:
    k = KafkaConfig(bootstrap_servers="b:9092")
    assert missing(["a", "b", "a", "c"], {"b"}) == ["a", "c"]
    require_topics("kafka.output_topic", ["b"], {"b"}, k)  # present: nothing raised
    with pytest.raises(ConfigError) as err:
        require_topics("kafka.output_topic", ["infer.resutls"], {"infer.results", "x"}, k)
    text = str(err.value)
    assert text.startswith("kafka.output_topic: infer.resutls not found on b:9092 (create it")
    assert "infer-worker topics create" in text and "existing topics: infer.results, x" in text
    many = {f"t{i:02d}" for i in range(25)}
    with pytest.raises(ConfigError, match=r"t19 and 5 more\)$"):
        require_topics("kafka.input_topics", ["u", "v"], many, k)
    secured = KafkaConfig(bootstrap_servers="b:9093", security_protocol="SSL")
    with pytest.raises(ConfigError, match="may not Describe them"):
        require_topics("kafka.input_topics", ["u"], set(), secured)


def test_a_topic_gone_while_serving_is_one_line_per_topic_naming_its_setting() -> None:
    k = KafkaConfig(output_topic="out", dlq_topic="dlq", state_topic="st")
    gone = MissingTopics(k)
    with structlog.testing.capture_logs() as logs:
        for _ in range(50):
            assert gone.refused("out", UnknownTopicOrPartitionError())
        assert gone.refused("dlq", UnknownTopicOrPartitionError())
        assert not gone.refused("out", KafkaTimeoutError())  # another failure: the caller's
        assert not gone.refused("out", None)
        gone.delivered()  # it came back: a second disappearance is said again
        assert gone.refused("out", UnknownTopicOrPartitionError())
    lines = [(e["topic"], e["setting"]) for e in logs if e["event"] == "topic_missing"]
    assert lines == [("out", "kafka.output_topic"), ("dlq", "kafka.dlq_topic"),
                     ("out", "kafka.output_topic")]  # fmt: skip


def test_members_that_would_hold_no_partition_are_named() -> None:
    from worker.kafka.topiccheck import idle_members

    counts = {"req": 2, "urgent": 1, "bulk": 6}
    assert idle_members([(("req",), 2)], counts) is None
    problem = idle_members([(("req",), 4)], counts)
    assert problem is not None
    assert problem.startswith("--procs: 4 members read req (2): 2 partitions in all, so 2 ")
    assert "at least 4 partitions" in problem
    # Lanes of their own: each group of members is held to its own topics.
    lanes = [(("bulk",), 2), (("urgent",), 2)]
    assert "urgent (1): 1 partition in all, so 1 would" in str(idle_members(lanes, counts))
    assert idle_members([(("req", "urgent"), 3)], counts) is None  # 3 partitions, 3 members
    assert idle_members([(("gone",), 3)], counts) is None  # missing: the members name it
