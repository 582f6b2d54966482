"""``[[kafka.lanes]]``: priority lanes over the input topics (docs/guides/lanes.md).

Each lane names some of ``kafka.input_topics`` and a priority (0 is served
first). Without lanes every input topic is one lane, as before lanes existed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from worker.config.checks import check


@dataclass(frozen=True)
class LaneConfig:
    # The lane's input topics (each also in kafka.input_topics; a topic belongs to one
    # lane).
    topics: tuple[str, ...] = ()
    # Lower is served first; unique across lanes.
    priority: int = 0
    # The lane's label in metrics and logs; "" = its first topic.
    name: str = ""
    # How long a request of this lane may wait for its batch to fill; None =
    # batching.max_queue_delay_ms. A batch is sent once any of its lanes' oldest
    # request has waited its lane's delay.
    max_queue_delay_ms: float | None = None
    # Never starved: while it has requests waiting, at least this share of every
    # batch's rows goes to this lane (rounded up to a whole row), whatever the
    # lanes above it have waiting. 0 = only the rows the lanes above leave.
    min_share: float = 0.0
    # Served by a worker process of its own (`run` starts it beside the process
    # of the other lanes, in the same group): its own event loop and interpreter
    # lock, so its requests never wait behind the other lanes' Python. The lanes
    # of one process share its batches; a lane of its own shares nothing but the
    # host (and the device). Needs another lane.
    own_process: bool = False
    # At most this many of the lane's requests a second go into batches (a
    # backfill's throttle); 0 = no cap. What it leaves is headroom for the lanes
    # above on a shared host (docs/guides/lanes.md). Requests held back wait in
    # their lane, in order; their deadlines still apply. Per worker process: N
    # processes reading the lane take up to N times it.
    max_records_per_s: float = 0.0

    @property
    def label(self) -> str:
        return self.name or (self.topics[0] if self.topics else "")

    def literal(self) -> str:
        """This lane as a TOML inline table: how ``run`` hands a member process
        its lanes (``INFER_WORKER_KAFKA__LANES``), read back by the same loader."""
        fields = [
            f"topics = {strings_literal(self.topics)}",
            f"priority = {self.priority}",
            f"name = {_quoted(self.name)}",
            f"min_share = {self.min_share!r}",
            f"own_process = {str(self.own_process).lower()}",
            f"max_records_per_s = {float(self.max_records_per_s)!r}",
        ]
        if self.max_queue_delay_ms is not None:
            fields.append(f"max_queue_delay_ms = {float(self.max_queue_delay_ms)!r}")
        return "{" + ", ".join(fields) + "}"


def lanes_literal(lanes: Sequence[LaneConfig]) -> str:
    """``lanes`` as a TOML array of inline tables (``LaneConfig.literal``)."""
    return "[" + ", ".join(lane.literal() for lane in lanes) + "]"


def strings_literal(items: Sequence[str]) -> str:
    """``items`` as a TOML array of strings (``kafka.input_topics`` for a member)."""
    return "[" + ", ".join(_quoted(item) for item in items) + "]"


def _quoted(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's for these characters)."""
    return json.dumps(text, ensure_ascii=False)


DEFAULT_LANE = "default"


def ranked(input_topics: Sequence[str], lanes: Sequence[LaneConfig]) -> tuple[LaneConfig, ...]:
    """The lanes, most urgent first; without lanes, one lane of every input topic
    (named ``default``)."""
    if not lanes:
        return (LaneConfig(topics=tuple(input_topics), name=DEFAULT_LANE),)
    return tuple(sorted(lanes, key=lambda lane: lane.priority))


def check_lanes(input_topics: Sequence[str], lanes: Sequence[LaneConfig]) -> None:
    """Every lane names input topics, each topic is in exactly one lane, and
    priorities and shares are in range; a ConfigError names the setting."""
    if not lanes:
        return
    seen: dict[str, int] = {}
    for i, lane in enumerate(lanes):
        at = f"kafka.lanes[{i}]"
        check(bool(lane.topics), f"{at}.topics", "needs at least one input topic")
        for topic in lane.topics:
            check(
                topic in input_topics,
                f"{at}.topics",
                f"{topic!r} is not in kafka.input_topics (add it there too)",
            )
            check(
                topic not in seen,
                f"{at}.topics",
                f"{topic!r} is already in kafka.lanes[{seen.get(topic)}]: a topic has one lane",
            )
            seen[topic] = i
        check(
            0.0 <= lane.min_share < 1.0 and math.isfinite(lane.min_share),
            f"{at}.min_share",
            f"must be >= 0 and < 1, got {lane.min_share}",
        )
        check(
            math.isfinite(lane.max_records_per_s) and lane.max_records_per_s >= 0,
            f"{at}.max_records_per_s",
            f"must be a finite number >= 0 (0: no cap), got {lane.max_records_per_s}",
        )
        check(
            lane.max_queue_delay_ms is None
            or (math.isfinite(lane.max_queue_delay_ms) and lane.max_queue_delay_ms >= 0),
            f"{at}.max_queue_delay_ms",
            "must be a finite number >= 0",
        )
    missing = [t for t in input_topics if t not in seen]
    check(
        not missing,
        "kafka.lanes",
        f"input topic {missing[0]!r} is in no lane: with lanes, name every input topic in one"
        if missing
        else "",
    )
    priorities = [lane.priority for lane in lanes]
    check(
        len(set(priorities)) == len(priorities),
        "kafka.lanes",
        f"two lanes have the same priority ({sorted(priorities)}): give each its own",
    )
    labels = [lane.label for lane in lanes]
    check(
        len(set(labels)) == len(labels),
        "kafka.lanes",
        f"two lanes have the same name ({sorted(labels)}): names label metrics",
    )
    alone = [i for i, lane in enumerate(lanes) if lane.own_process]
    check(
        not alone or len(lanes) > 1,
        f"kafka.lanes[{alone[0] if alone else 0}].own_process",
        "needs another lane: a single lane already has the worker to itself",
    )
    check(
        sum(lane.min_share for lane in lanes) < 1.0,
        "kafka.lanes",
        "the lanes' min_share add up to 1 or more: leave room for the lanes above",
    )
