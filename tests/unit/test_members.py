"""The processes ``run`` starts (``worker.app.supervisor.members``): ``--procs N``
members, and a lane with ``own_process = true`` served by members of its own,
each child's settings read back by the same loader the child uses."""

from __future__ import annotations

import dataclasses

import pytest

from worker.app.supervisor import child_env, child_envs, compile_threads, members, supervised
from worker.config import LaneConfig, Settings, load_settings
from worker.config.lanes import lanes_literal
from worker.flow.errors import ConfigError
from worker.ops.processes import override_env

URGENT = '{topics = ["urgent"], priority = 0, name = "urgent", max_queue_delay_ms = 2, own_process = true}'  # noqa: E501
BULK = '{topics = ["bulk", "backfill"], priority = 1, name = "bulk", min_share = 0.1}'


def _env(lanes: str | None = None, **more: str) -> dict[str, str]:
    """A parent's ``INFER_WORKER_*`` variables: its whole configuration here."""
    values = {"kafka.input_topics": '["urgent", "bulk", "backfill"]', "metrics.port": "9100"}
    if lanes is not None:
        values["kafka.lanes"] = lanes
    return override_env({**values, **more})


def _settings(lanes: str | None = None, **more: str) -> Settings:
    return load_settings(env=_env(lanes, **more))


def _children(procs: int, lanes: str | None = None, **more: str) -> list[Settings]:
    """The settings each child reads: the parent's variables, then its member's."""
    env = _env(lanes, **more)
    return [load_settings(env=child_env(env, m)) for m in members(load_settings(env=env), procs)]


def test_a_lane_of_its_own_gets_a_process_and_the_others_share_one() -> None:
    parent = _settings(f"[{URGENT}, {BULK}]", **{"kafka.group_instance_id": "pod-a"})
    assert supervised(parent, 1)
    shared, alone = _children(1, f"[{URGENT}, {BULK}]", **{"kafka.group_instance_id": "pod-a"})
    # the lanes that share: their topics, their lane, the member's own ids
    assert shared.kafka.input_topics == ("bulk", "backfill")
    assert [lane.label for lane in shared.kafka.ranked_lanes] == ["bulk"]
    assert shared.kafka.ranked_lanes[0].min_share == 0.1
    assert shared.kafka.group_instance_id == "pod-a"  # unchanged: its transactions too
    # the lane of its own: one lane, its settings kept, not started again below it
    assert alone.kafka.input_topics == ("urgent",)
    (lane,) = alone.kafka.ranked_lanes
    assert (lane.label, lane.max_queue_delay_ms, lane.own_process) == ("urgent", 2.0, False)
    assert not supervised(alone, 1) and not supervised(shared, 1)
    assert alone.kafka.group_instance_id == "pod-a-urgent"
    assert alone.kafka.member_transactional_id == "infer-worker.pod-a-urgent"
    assert shared.kafka.group_id == alone.kafka.group_id  # one group
    assert [shared.metrics.port, alone.metrics.port] == [9100, 9101]
    assert shared.kafka.client_id != alone.kafka.client_id


def test_procs_members_each_get_the_lanes_and_ids_of_their_own() -> None:
    children = _children(2, f"[{URGENT}, {BULK}]", **{"kafka.group_instance_id": "pod-a",
                                                      "kafka.transactional_id": "tx"})  # fmt: skip
    assert [c.kafka.input_topics for c in children] == [
        ("bulk", "backfill"), ("urgent",), ("bulk", "backfill"), ("urgent",)]  # fmt: skip
    assert [c.kafka.group_instance_id for c in children] == [
        "pod-a-0", "pod-a-0-urgent", "pod-a-1", "pod-a-1-urgent"]  # fmt: skip
    assert [c.kafka.member_transactional_id for c in children] == [
        "tx-0", "tx-0-urgent", "tx-1", "tx-1-urgent"]  # fmt: skip
    assert [c.metrics.port for c in children] == [9100, 9101, 9102, 9103]


def test_without_lanes_of_their_own_procs_members_keep_the_configuration() -> None:
    shared = f"[{URGENT.replace('true', 'false')}, {BULK}]"
    parent = _settings(shared, **{"kafka.group_instance_id": "pod-a"})
    assert not supervised(parent, 1) and supervised(parent, 2)
    (only,) = members(parent, 1)
    assert only == {
        "INFER_WORKER_METRICS__PORT": "9100",
        "INFER_WORKER_KAFKA__CLIENT_ID": "infer-worker-0",
        "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": parent.kafka.bootstrap_servers,
    }
    one, two = _children(2, shared, **{"kafka.group_instance_id": "pod-a"})
    assert one.kafka.input_topics == two.kafka.input_topics == parent.kafka.input_topics
    assert [lane.label for lane in two.kafka.ranked_lanes] == ["urgent", "bulk"]
    # two members with one static id would fence each other
    assert [one.kafka.group_instance_id, two.kafka.group_instance_id] == ["pod-a-0", "pod-a-1"]


def test_every_lane_of_its_own_and_no_metrics_port() -> None:
    bulk_alone = BULK.replace("}", ", own_process = true}")
    children = _children(1, f"[{URGENT}, {bulk_alone}]", **{"metrics.port": "0"})
    assert [c.kafka.input_topics for c in children] == [("urgent",), ("bulk", "backfill")]
    assert [c.metrics.port for c in children] == [0, 0]
    assert [c.kafka.group_instance_id for c in children] == ["", ""]  # dynamic members


@pytest.mark.parametrize(
    "lane",
    [
        LaneConfig(topics=("a",)),
        LaneConfig(
            ("a b", 'q"t', "é"),
            priority=3,
            name="n\\x",
            max_queue_delay_ms=0.5,
            min_share=0.25,
            own_process=True,
            max_records_per_s=2500.5,
        ),
    ],
)
def test_a_lane_literal_reads_back_as_the_same_lane(lane: LaneConfig) -> None:
    other = LaneConfig(topics=("z",), priority=9)
    topics = ",".join([*lane.topics, "z"])
    env = override_env({"kafka.input_topics": topics}) | {
        "INFER_WORKER_KAFKA__LANES": lanes_literal([lane, other])
    }
    read = load_settings(env=env).kafka.lanes
    assert read == (lane, other)


def test_a_single_lane_of_its_own_is_a_config_error_naming_the_setting() -> None:
    lanes = '[{topics = ["a"], own_process = true}]'
    env = override_env({"kafka.input_topics": "a", "kafka.lanes": lanes})
    with pytest.raises(ConfigError, match=r"kafka\.lanes\[0\]\.own_process: needs another lane"):
        load_settings(env=env)


def test_members_do_not_change_the_parent() -> None:
    parent = _settings(f"[{URGENT}, {BULK}]")
    before = dataclasses.replace(parent)
    members(parent, 3)
    assert parent == before


def test_a_lane_of_its_own_keeps_its_lane_metrics_and_its_fifo_batches() -> None:
    from worker.app.lanes import batch_policy
    from worker.flow.batching import BatchPolicy
    from worker.flow.messages import Job, TopicPartition
    from worker.obs import metrics

    _, alone = _children(1, f"[{URGENT}, {BULK}]")
    policy = batch_policy(alone)
    assert isinstance(policy, BatchPolicy)  # one lane: batches as without lanes
    rows = metrics.LANE_ROWS.labels(lane="urgent")
    before = rows._value.get()
    policy.add(Job(TopicPartition("urgent", 0), 7, None, arrived=0.0, deadline=None))
    assert policy.drain(1.0) is not None
    assert rows._value.get() == before + 1
    unconfigured = batch_policy(load_settings(env=override_env({"kafka.input_topics": "a"})))
    assert isinstance(unconfigured, BatchPolicy) and unconfigured.observe is None


def test_torch_members_split_the_compile_workers_unless_the_operator_set_them() -> None:
    torch_run = _settings(**{"model.backend": "torch", "model.path": "engines/m.pt2"})
    assert compile_threads(torch_run, {}, 4, 16) == {"TORCHINDUCTOR_COMPILE_THREADS": "4"}
    assert compile_threads(torch_run, {}, 3, 2) == {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert compile_threads(torch_run, {"TORCHINDUCTOR_COMPILE_THREADS": "8"}, 4, 16) == {}
    assert compile_threads(torch_run, {}, 1, 16) == {}  # one process: torch's own choice
    assert compile_threads(_settings(), {}, 4, 16) == {}  # onnxruntime compiles nothing
    # What run --procs 2 starts: each member with its own settings and the split.
    envs = child_envs(torch_run, members(torch_run, 2), {"PATH": "/bin"}, 16)
    assert [e["TORCHINDUCTOR_COMPILE_THREADS"] for e in envs] == ["8", "8"]
    ids = [e["INFER_WORKER_KAFKA__CLIENT_ID"] for e in envs]
    assert ids == ["infer-worker-0", "infer-worker-1"]
    assert all(e["PATH"] == "/bin" for e in envs)
