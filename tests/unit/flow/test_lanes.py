"""Priority lanes as pure decisions (issue 39): which requests a batch takes
(urgent first, lower lanes fill, min_share kept), when a lane's batch is due,
order within a lane, and which lane's partitions pause first. Injected clock."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.config import KafkaConfig, LaneConfig, load_settings
from worker.flow.batching import MicroBatcher
from worker.flow.errors import ConfigError
from worker.flow.lanes import Lane, LaneBackpressure, LanePolicy, reserved_rows
from worker.flow.messages import Batch
from worker.flow.room import Room
from worker.ops.processes import override_env


@dataclass
class Item:
    lane: int
    n: int
    arrived: float = 0.0
    deadline: float | None = None


URGENT, BULK = Lane(0, "urgent", delay=0.002), Lane(1, "bulk", delay=0.010, min_share=0.1)


def policy(*lanes: Lane, max_size: int = 10, capacity: int = 1000) -> LanePolicy[Item]:
    return LanePolicy(lanes or (URGENT, BULK), lambda i: i.lane, max_size, capacity=capacity)


def test_urgent_first_and_the_lower_lane_fills_the_rest() -> None:
    p = policy(URGENT, Lane(1, "bulk", delay=0.010))
    for n in range(30):
        p.add(Item(1, n))
    for n in range(3):
        p.add(Item(0, 100 + n))
    batch = p.take(0.0, queue_drained=False)
    assert batch is not None and batch.reason == "full"
    assert [(i.lane, i.n) for i in batch.items] == [(0, 100), (0, 101), (0, 102)] + [
        (1, n) for n in range(7)
    ]
    nxt = p.take(0.0, queue_drained=False)
    assert nxt is not None and [i.n for i in nxt.items] == list(range(7, 17))  # FIFO in a lane


def test_min_share_holds_while_the_urgent_lane_could_fill_every_batch() -> None:
    p = policy(max_size=64)
    for n in range(1000):
        p.add(Item(0, n))
    for n in range(1000):
        p.add(Item(1, n))
    rows = Counter[int]()
    for _ in range(10):
        batch = p.take(0.0, queue_drained=False)
        assert batch is not None and len(batch.items) == 64
        rows.update(i.lane for i in batch.items)
        assert sum(i.lane == 1 for i in batch.items) == reserved_rows(0.1, 64) == 7
    assert rows[1] / (rows[0] + rows[1]) >= 0.1


def test_a_lane_without_work_leaves_its_share_to_the_others() -> None:
    p = policy(max_size=8)
    for n in range(20):
        p.add(Item(0, n))
    batch = p.take(0.0, queue_drained=False)
    assert batch is not None and [i.lane for i in batch.items] == [0] * 8


def test_each_lane_is_due_after_its_own_delay() -> None:
    p = policy()
    p.add(Item(1, 0, arrived=1.000))  # bulk: due at 1.010
    assert p.next_flush_at() == pytest.approx(1.010)
    p.add(Item(0, 1, arrived=1.005))  # urgent: due at 1.007
    assert p.next_flush_at() == pytest.approx(1.007)
    assert p.take(1.006, queue_drained=True) is None
    batch = p.take(1.007, queue_drained=True)
    assert batch is not None and batch.reason == "delay"
    assert [(i.lane, i.n) for i in batch.items] == [(0, 1), (1, 0)]  # rank order, all of it


def test_a_deadline_makes_a_batch_due_before_the_delays() -> None:
    p = policy()
    p.service_time = 0.004
    p.add(Item(1, 0, arrived=0.0, deadline=0.005))
    assert p.next_flush_at() == pytest.approx(0.001)
    batch = p.take(0.001, queue_drained=True)
    assert batch is not None and batch.reason == "deadline"
    p.add(Item(1, 1, arrived=0.0))
    assert p.next_flush_at() == pytest.approx(0.010)  # the cut deadline is forgotten


def test_it_reads_past_one_batch_up_to_its_capacity() -> None:
    p = policy(max_size=4, capacity=6)
    for n in range(6):
        assert p.has_room
        p.add(Item(1, n))
    assert not p.has_room


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.floats(0, 0.05)), min_size=1, max_size=200),
    st.integers(1, 16),
)
def test_nothing_lost_and_order_kept_in_each_lane(
    arrivals: list[tuple[int, float]], max_size: int
) -> None:
    lanes = (Lane(0, "a", 0.001), Lane(1, "b", 0.004, 0.2), Lane(2, "c", 0.002, 0.3))
    p = policy(*lanes, max_size=max_size)
    out: list[Item] = []
    now = 0.0
    for n, (lane, gap) in enumerate(arrivals):
        now += gap
        p.add(Item(lane, n, arrived=now))
        while (batch := p.take(now, queue_drained=False)) is not None:
            assert 1 <= len(batch.items) <= max_size
            out.extend(batch.items)
    last = p.drain(now + 1)
    out.extend(last.items if last else [])
    assert sorted(i.n for i in out) == list(range(len(arrivals)))
    for lane in range(3):
        ns = [i.n for i in out if i.lane == lane]
        assert ns == sorted(ns)


async def test_the_batcher_takes_an_urgent_request_queued_behind_a_backlog() -> None:
    """The batcher reads the queue into the lanes (past one batch), so an urgent
    request behind 500 bulk ones is in the next batch."""
    items: asyncio.Queue[Item | None] = asyncio.Queue()
    out: asyncio.Queue[Batch[Item] | None] = asyncio.Queue()
    for n in range(500):
        items.put_nowait(Item(1, n))
    items.put_nowait(Item(0, 999))
    items.put_nowait(None)
    await MicroBatcher(items, out, policy(max_size=16)).run()
    first = await out.get()
    assert first is not None and first.items[0].n == 999


async def test_a_batch_is_cut_when_the_engine_can_start_it_so_urgent_requests_go_first() -> None:
    """With room for one batch on the engine, the batcher cuts one and waits: the
    bulk backlog stays in the lanes, not in batches cut ahead of time, so an
    urgent request that arrives while the engine is busy is in the next batch."""
    items: asyncio.Queue[Item | None] = asyncio.Queue()
    out: asyncio.Queue[Batch[Item] | None] = asyncio.Queue()
    room = Room(1)
    for n in range(64):
        items.put_nowait(Item(1, n))
    task = asyncio.create_task(MicroBatcher(items, out, policy(max_size=16), room=room).run())
    try:
        first = await asyncio.wait_for(out.get(), 5)
        assert first is not None and [i.n for i in first.items] == list(range(16))
        await asyncio.sleep(0.05)
        assert out.empty() and not room.free  # nothing cut while the engine is busy
        items.put_nowait(Item(0, 999))
        await asyncio.sleep(0.01)
        room.give_back()  # the first batch is done
        second = await asyncio.wait_for(out.get(), 5)
        assert second is not None and second.items[0].n == 999
        assert [i.n for i in second.items[1:]] == list(range(16, 31))
    finally:
        task.cancel()


def test_the_lowest_lane_pauses_first_and_resumes_last() -> None:
    bp = LaneBackpressure(max_records=100, max_bytes=1 << 30, lanes=3)
    assert bp.update(99, 0) == []
    assert bp.update(100, 0) == [(2, "pause")]  # bulk at the bound
    assert bp.update(124, 0) == []
    assert bp.update(125, 0) == [(1, "pause")]  # the middle lane at 1.25x
    assert bp.is_paused(1) and not bp.is_paused(0) and bp.paused
    assert bp.update(150, 0) == [(0, "pause")]  # the most urgent at 1.5x
    assert bp.update(75, 0) == [(0, "resume")]  # 0.5 of 150: urgent resumes first
    assert bp.update(62, 0) == [(1, "resume")]
    assert bp.update(51, 0) == []
    assert bp.update(50, 0) == [(2, "resume")]  # bulk last
    assert not bp.paused


def test_one_lane_pauses_exactly_as_before_lanes() -> None:
    bp = LaneBackpressure(max_records=100, max_bytes=1000)
    assert bp.update(100, 0) == [(0, "pause")] and bp.update(51, 0) == []
    assert bp.update(50, 0) == [(0, "resume")]
    assert bp.update(0, 1000) == [(0, "pause")]


def test_several_models_pause_each_on_its_own_counts_at_its_own_bounds() -> None:
    bp = LaneBackpressure.per_model([(100, 1000), (10, 1000)], ["scores", "reviews"])
    assert bp.apart and bp.labels == ["scores", "reviews"]
    # A backlog of the first model pauses it alone, whatever the worker holds in all.
    assert bp.update_each([(100, 0), (3, 0)]) == [(0, "pause")]
    assert bp.is_paused(0) and not bp.is_paused(1) and not bp.all_paused
    assert bp.update_each([(100, 0), (10, 0)]) == [(1, "pause")]  # the second's own bound
    assert bp.all_paused
    assert bp.update_each([(50, 0), (5, 0)]) == [(1, "resume"), (0, "resume")]
    assert bp.update_each([(0, 1000), (0, 0)]) == [(0, "pause")]  # bytes too


def test_lanes_from_settings_rank_by_priority_and_default_to_one_lane() -> None:
    k = KafkaConfig(
        input_topics=("bulk", "urgent"),
        lanes=(LaneConfig(topics=("bulk",), priority=5), LaneConfig(("urgent",), priority=1)),
    )
    assert [lane.label for lane in k.ranked_lanes] == ["urgent", "bulk"]
    assert k.lane_rank == {"urgent": 0, "bulk": 1}
    assert KafkaConfig(input_topics=("a", "b")).lane_rank == {"a": 0, "b": 0}


@pytest.mark.parametrize(
    ("lanes", "message"),
    [
        ('[{topics = ["a"]}]', r"kafka\.lanes: input topic 'b' is in no lane"),
        ('[{topics = ["a", "c"]}, {topics = ["b"], priority = 1}]',
         r"kafka\.lanes\[0\]\.topics: 'c' is not in kafka\.input_topics"),
        ('[{topics = ["a"]}, {topics = ["a", "b"], priority = 1}]',
         r"kafka\.lanes\[1\]\.topics: 'a' is already in kafka\.lanes\[0\]"),
        ('[{topics = ["a"]}, {topics = ["b"], priority = 1, min_share = 1.0}]',
         r"kafka\.lanes\[1\]\.min_share: must be >= 0 and < 1"),
        ('[{topics = ["a"], min_share = 0.6}, {topics = ["b"], priority = 1, min_share = 0.5}]',
         r"kafka\.lanes: the lanes' min_share add up to 1 or more"),
        ('[{topics = ["a"]}, {topics = ["b"]}]', r"kafka\.lanes: two lanes have the same priority"),
        ('[{topics = []}, {topics = ["a", "b"], priority = 1}]',
         r"kafka\.lanes\[0\]\.topics: needs at least one input topic"),
        ('[{topics = ["a"], max_queue_delay_ms = -1}, {topics = ["b"], priority = 1}]',
         r"kafka\.lanes\[0\]\.max_queue_delay_ms: must be a finite number >= 0"),
        ('[{topics = ["a"]}, {topics = ["b"], priority = 1, max_records_per_s = -5}]',
         r"kafka\.lanes\[1\]\.max_records_per_s: must be a finite number >= 0 \(0: no cap\)"),
        ('[{topics = ["a"]}, {topics = ["b"], priority = 1, max_records_per_s = inf}]',
         r"kafka\.lanes\[1\]\.max_records_per_s: must be a finite number >= 0"),
    ],
)  # fmt: skip
def test_a_bad_lane_is_a_config_error_naming_the_setting(lanes: str, message: str) -> None:
    env = override_env({"kafka.input_topics": '["a", "b"]', "kafka.lanes": lanes})
    with pytest.raises(ConfigError, match=message):
        load_settings(env=env)


def test_lanes_in_a_toml_file(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(
        '[kafka]\ninput_topics = ["infer.interactive", "infer.bulk"]\n'
        '[[kafka.lanes]]\ntopics = ["infer.interactive"]\npriority = 0\nmax_queue_delay_ms = 1\n'
        '[[kafka.lanes]]\ntopics = ["infer.bulk"]\npriority = 1\nmin_share = 0.1\n'
    )
    s = load_settings(config, env={})
    interactive, bulk = s.kafka.ranked_lanes
    assert interactive.max_queue_delay_ms == 1.0 and bulk.min_share == 0.1
    assert [lane.label for lane in s.kafka.ranked_lanes] == ["infer.interactive", "infer.bulk"]


def test_the_aiokafka_fetcher_still_has_the_backoff_lanes_shorten() -> None:
    """worker.kafka.lanefetch sets the fetcher's private ``_prefetch_backoff``
    (aiokafka takes no such consumer argument): an aiokafka that renames it
    must fail here, not silently bring back 100 ms fetch delays."""
    import inspect

    from aiokafka.consumer.fetcher import Fetcher

    assert "prefetch_backoff" in inspect.signature(Fetcher.__init__).parameters
    assert "self._prefetch_backoff = prefetch_backoff" in inspect.getsource(Fetcher.__init__)


def test_several_models_shorten_the_prefetch_backoff_as_lanes_do() -> None:
    """One model's buffered backlog must not hold a fetch of another's records for
    aiokafka's 100 ms: the worker's consumer shortens it where models are paused
    apart (BENCHMARKS.md, several models)."""
    from types import SimpleNamespace
    from typing import Any, cast

    from worker.kafka.lanefetch import LANES_PREFETCH_BACKOFF_S, fetch_for_lanes

    fetcher = SimpleNamespace(_prefetch_backoff=0.1)
    consumer = cast(Any, SimpleNamespace(_fetcher=fetcher))
    plain = KafkaConfig(input_topics=("a", "b"))
    assert not fetch_for_lanes(consumer, plain) and fetcher._prefetch_backoff == 0.1
    assert fetch_for_lanes(consumer, plain, apart=True)
    assert fetcher._prefetch_backoff == LANES_PREFETCH_BACKOFF_S


def test_with_lanes_a_partition_fetch_is_small_unless_set() -> None:
    lanes = (LaneConfig(("a",)), LaneConfig(("b",), priority=1))
    assert KafkaConfig(input_topics=("a", "b")).max_partition_fetch_bytes == 1 << 20
    assert KafkaConfig(input_topics=("a", "b"), lanes=lanes).max_partition_fetch_bytes == 65536
    given = KafkaConfig(input_topics=("a", "b"), lanes=lanes, max_partition_fetch_bytes=1 << 22)
    assert given.max_partition_fetch_bytes == 1 << 22
