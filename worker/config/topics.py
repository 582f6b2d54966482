"""The topics a configuration needs, listed once: what ``infer-worker topics
create`` makes, what ``topics check`` and the worker's start-up check look for,
and what the secured cluster's permissions are checked on.

Each with the setting that names it, how it is used (read, written or both),
its partitions and configs where the worker needs them, and whether the worker
refuses to start without it (the default crash-guard topic is optional: without
it crash-loop protection is off, said at start; the state changelog is checked
at start with its partitions, ``worker.app.states``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

from worker.config.kafka import DEFAULT_CRASH_GUARD_TOPIC
from worker.config.models import served

if TYPE_CHECKING:
    from worker.config import Settings

COMPACTED: Final = {"cleanup.policy": "compact"}

# The partitions of the input and output topics ``topics create`` makes by default.
DEFAULT_PARTITIONS: Final = 6

Use = Literal["read", "write", "both"]


@dataclass(frozen=True)
class NeededTopic:
    name: str
    setting: str
    partitions: int | None  # None: as many as the input topic has (a changelog)
    configs: dict[str, str] = field(default_factory=dict)
    use: Use = "write"
    # The worker stops at start (exit 2 naming ``setting``) where it is missing.
    required: bool = True
    # The input topic it must have as many partitions as (a state changelog's).
    co_partitioned: str = ""


def needed_topics(s: Settings, partitions: int = DEFAULT_PARTITIONS) -> list[NeededTopic]:
    """The topics the worker configured by ``s`` reads or writes, in that order."""
    k = s.kafka
    out = [NeededTopic(t, "kafka.input_topics", partitions, use="read") for t in k.input_topics]
    out.append(NeededTopic(k.output_topic, "kafka.output_topic", partitions))
    if not k.shadow:  # a shadow writes no DLQ records and keeps no crash guard
        out.append(NeededTopic(k.dlq_topic, "kafka.dlq_topic", 1))
        if s.limits.max_crash_attempts > 0:
            named = k.crash_guard_topic != DEFAULT_CRASH_GUARD_TOPIC
            out.append(NeededTopic(k.crash_guard_topic, "kafka.crash_guard_topic", 1,
                                   dict(COMPACTED), use="both", required=named))  # fmt: skip
    if k.control_topic:  # read from the beginning by every member; one partition: one order
        out.append(NeededTopic(k.control_topic, "kafka.control_topic", 1, dict(COMPACTED),
                               use="read"))
    if k.state_topic:
        out.append(NeededTopic(k.state_topic, "kafka.state_topic", None, dict(COMPACTED),
                               use="both", required=False,
                               co_partitioned=k.input_topics[0] if k.input_topics else ""))
    for m in served(s):  # each stateful model's own changelog, beside other models
        if state := _changelog(s, m.key, m.name):
            partner = m.topics[0] if len(m.topics) == 1 else ""
            out.append(NeededTopic(state, f"{m.key}.state_topic", None, dict(COMPACTED),
                                   use="both", required=False, co_partitioned=partner))
    for name, p in s.pipelines.items():
        for i, step in enumerate(p.steps):
            if step.topic:  # a step's audit topic
                out.append(NeededTopic(step.topic, f"pipelines.{name}.steps[{i}].topic",
                                       partitions))  # fmt: skip
    return out


def _changelog(s: Settings, key: str, name: str) -> str:
    """The changelog a model's section names (``model.state_topic`` or
    ``models.NAME.state_topic``, a repository model's file alike), or ""."""
    if key == "model":
        return s.model.state_topic
    return s.models[name].state_topic
