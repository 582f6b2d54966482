"""Priority lanes end to end (issue 39), on both brokers: a worker draining a
bulk backlog answers urgent requests produced behind it long before the
backlog is done; a SIGKILL in the middle loses nothing in either lane; under
exactly-once (Apache Kafka) every request of both lanes is answered once, with
the lanes in one process and with the urgent lane in a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import check, read_topics

from .conftest import FAST_GROUP, Answers, no_crash_in_log, request, wait_assigned

pytestmark = pytest.mark.faults

# BULK: a backlog the worker needs well over the 0.1-0.15 s the urgent requests take to
# produce (12,000 once ran through in that window on the embedded broker, 2026-11-29).
PARTS, BULK, URGENT, READ_AHEAD = 2, 24_000, 40, 6_000


def topics(names: Mapping[str, str]) -> tuple[str, str]:
    return f"{names['requests']}.urgent", f"{names['requests']}.bulk"


def start_with_lanes(
    broker: Broker, names: Mapping[str, str], own: bool = False, bulk_rate: float = 0, **env: str
) -> WorkerProcess:
    """``own``: the urgent lane in a process of its own (member 1, metrics on
    port + 1; the bulk lane's is member 0); ``bulk_rate``: the bulk lane's
    ``max_records_per_s``."""
    urgent, bulk = topics(names)
    lanes = (
        f'[{{topics = ["{urgent}"], priority = 0, name = "urgent", max_queue_delay_ms = 1, '
        f"own_process = {str(own).lower()}}}, "
        f'{{topics = ["{bulk}"], priority = 1, name = "bulk", min_share = 0.1, '
        f"max_records_per_s = {float(bulk_rate)!r}}}]"
    )
    return spawn_worker(
        broker.bootstrap,
        input_topics=[urgent, bulk],
        output_topic=names["results"],
        dlq_topic=names["dlq"],
        group_id=names["group"],
        extra_env={
            **FAST_GROUP,
            "INFER_WORKER_KAFKA__LANES": lanes,
            # A deep read-ahead: without lanes an urgent request would queue in
            # the worker behind up to this many bulk ones.
            "INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS": str(READ_AHEAD),
            "INFER_WORKER_BATCHING__QUEUE_CAPACITY": str(READ_AHEAD),
            **env,
        },
        members=2 if own else 1,
    )


def _dispatched(w: WorkerProcess, lane: str) -> float:
    try:
        return w.metrics().get(f'infer_lane_rows_total{{lane="{lane}"}}', 0.0)
    except OSError:  # not serving metrics yet
        return 0.0


def by_topic(c: Collector) -> Counter[str]:
    """Distinct requests answered, per input topic."""
    seen = {
        (r.result().source.topic, r.result().source.partition, r.result().source.offset)
        for recs in c.records.values()
        for r in recs
    }
    return Counter(t for t, _, _ in seen)


async def until(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def _backlog(
    broker: Broker, names: Mapping[str, str], requests: int = BULK
) -> tuple[str, str]:
    urgent, bulk = topics(names)
    await create_topics(
        broker.bootstrap,
        {urgent: PARTS, bulk: PARTS, names["results"]: PARTS, names["dlq"]: 1},
    )
    await produce_all(
        broker.bootstrap,
        bulk,
        [(f"b{i}".encode(), request(i)) for i in range(requests)],
        partition_of=lambda i: i % PARTS,
    )
    return urgent, bulk


def _lane_queue(w: WorkerProcess) -> dict[str, tuple[float, float]]:
    """Each lane's queue-time (sum, count) so far."""
    m = w.metrics()
    return {
        lane: (
            m.get(f'infer_lane_queue_seconds_sum{{lane="{lane}"}}', 0.0),
            m.get(f'infer_lane_queue_seconds_count{{lane="{lane}"}}', 0.0),
        )
        for lane in ("urgent", "bulk")
    }


async def urgent_overtakes_bulk(
    broker: Broker, urgent: str, w: WorkerProcess, within: float = 60
) -> dict[str, float]:
    """Once ``w`` drains the bulk backlog, produce the urgent requests (spread
    over 0.1 s) and check that the backlog is still running when the last of them
    is in a batch: ranked below it, they would not be fetched until it is through.
    Returns both lanes' mean queue seconds over that window, for the log.

    The spread was 0.4 s until 2026-11-27: on the embedded broker the worker
    drains the 12,000-request backlog in about 0.6 s, and one run in eight had
    taken 11,000 of it by the time the last urgent request was even produced
    (then dispatched 0.11 s later, with 72 bulk requests left): a test of the
    harness's timing, not of the order. So the backlog left when they are all
    produced is checked too, and said apart from an urgent lane served late; and
    on 2026-11-29 one run had all 12,000 dispatched by then (0.15 s after 500
    were): the backlog is 24,000 since.

    Until issue 39's fetch change this also held the urgent mean queue time
    under a third of the bulk one's (about 5 ms against 100). Since a lower
    lane's records are handed over LOWER_LANE_RECORDS at a time, the bulk
    backlog waits in the fetch buffer, upstream of the batcher, and both lanes'
    queue times are a few ms: that comparison no longer says which lane went
    first. The fetch order itself is held by tests/integration/test_lane_fetch.py."""
    await until(lambda: _dispatched(w, "bulk") >= 500, within, "bulk under way")
    before = _lane_queue(w)
    t0 = time.monotonic()
    await produce_all(
        broker.bootstrap,
        urgent,
        [(f"u{i}".encode(), request(100_000 + i)) for i in range(URGENT)],
        partition_of=lambda i: i % PARTS,
        rate=URGENT / 0.1,  # spread over ~0.1 s
    )
    produced = (time.monotonic() - t0, _dispatched(w, "bulk"))
    await until(lambda: _dispatched(w, "urgent") >= URGENT, 60, "urgent dispatched")
    after = _lane_queue(w)
    timeline = {"produced": produced, "dispatched": (time.monotonic() - t0, after["bulk"][1])}
    assert produced[1] <= BULK - 2000, (
        "the backlog was nearly through before the urgent "
        "requests were produced: the order is not tested",
        timeline,
    )
    # Not fetched until the backlog is through (a lane ranked below it), the
    # urgent requests would queue briefly, but after all of it.
    assert after["bulk"][1] <= BULK - 1000, (
        "the urgent requests waited for the backlog",
        after,
        timeline,
    )
    waits = {
        lane: (after[lane][0] - before[lane][0]) / max(1.0, after[lane][1] - before[lane][1])
        for lane in ("urgent", "bulk")
    }
    print("WAITS", waits, "TIMELINE", timeline)
    return waits


async def every_request_answered(broker: Broker, names: Mapping[str, str]) -> None:
    """Every request of both lanes answered with a result: none lost."""
    inputs, observed = await read_topics(
        broker.bootstrap, list(topics(names)), names["results"], names["dlq"], idle_timeout=1.5
    )
    report = check(inputs, observed.answers, unparseable=observed.unparseable)
    assert report.totals.lost == 0, report.format()
    assert all(a.kind == "result" for a in observed.answers)


async def committed_answers(
    broker: Broker, names: Mapping[str, str], expected: int, within: float = 120
) -> tuple[Any, Any]:
    """Both lanes' requests and the answers a read_committed client sees, once
    ``expected`` of them are there (or ``within`` seconds passed)."""
    deadline = time.monotonic() + within
    while True:
        inputs, observed = await read_topics(
            broker.bootstrap, list(topics(names)), names["results"], names["dlq"],
            idle_timeout=1.0, isolation_level="read_committed",
        )  # fmt: skip
        if len(observed.answers) >= expected or time.monotonic() >= deadline:
            return inputs, observed
        await asyncio.sleep(1.0)


def answered_once(inputs: Any, observed: Any) -> None:
    """Every request answered, none twice (exactly-once)."""
    report = check(inputs, observed.answers, unparseable=observed.unparseable, strict=True)
    assert report.totals.lost == 0 and report.totals.surplus_answers == 0, report.format()


class Members:
    """The workers a test started with lanes, killed when it ends."""

    def __init__(self, broker: Broker, names: Mapping[str, str], **env: str) -> None:
        self._broker, self._names, self._env = broker, names, env
        self.started: list[WorkerProcess] = []

    def start(self) -> WorkerProcess:
        self.started.append(start_with_lanes(self._broker, self._names, **self._env))
        return self.started[-1]


@contextlib.asynccontextmanager
async def members(
    broker: Broker, names: Mapping[str, str], **env: str
) -> AsyncIterator[tuple[Answers, Members]]:
    """Results collected and workers started for the block (``env``: more of
    their settings); every request of both lanes answered once it ended without
    failing."""
    answers = await Answers.start(broker, names)
    workers = Members(broker, names, **env)
    try:
        yield answers, workers
    finally:
        for w in workers.started:
            w.kill()
        await answers.stop()
    await every_request_answered(broker, names)


@pytest.mark.parametrize("models", [False, True], ids=["one-model", "a-model-a-lane"])
async def test_urgent_requests_overtake_a_backlog_and_a_sigkill_loses_nothing(
    broker: Broker, names: dict[str, str], models: bool
) -> None:
    """``models``: the urgent topic answered by [model], the bulk backlog by a
    [models.bulk] of its own (issue 64: lanes were refused with several models)."""
    urgent, bulk = await _backlog(broker, names)
    env = {"INFER_WORKER_MODEL__PATH": "builtin:digits", "INFER_WORKER_MODEL__TOPICS": urgent,
           "INFER_WORKER_MODELS__BULK__PATH": "builtin:digits",
           "INFER_WORKER_MODELS__BULK__TOPICS": bulk} if models else {}  # fmt: skip
    async with members(broker, names, **env) as (answers, workers):
        w1 = workers.start()
        await wait_assigned([w1], 2 * PARTS)
        await urgent_overtakes_bulk(broker, urgent, w1)
        w1.kill()  # SIGKILL mid-backlog
        w2 = workers.start()
        await until(lambda: by_topic(answers.collector)[bulk] >= BULK, 120, "backlog answered")
        assert w2.terminate() == 0, w2.log_tail()
        no_crash_in_log(w2)


@pytest.mark.parametrize("broker_kind", ["kafka"])
@pytest.mark.parametrize("own", [False, True], ids=["one-process", "own-process"])
async def test_exactly_once_with_lanes_answers_each_request_once(
    broker: Broker, names: dict[str, str], own: bool
) -> None:
    """``own``: the urgent lane in a process of its own, the two processes with
    transactional ids of their own (with one, they fence each other)."""
    urgent, _ = await _backlog(broker, names)
    eos = {
        "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
        "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "lanes-member",
    }
    w = start_with_lanes(broker, names, own, **eos)
    try:
        await wait_assigned(processes(w, own), 2 * PARTS)
        await produce_urgent(broker, urgent, 0)
        w.kill()  # the whole tree, mid-stream: the next members abort what was open
        w = start_with_lanes(broker, names, own, **eos)
        await wait_assigned(processes(w, own), 2 * PARTS)
        await produce_urgent(broker, urgent, URGENT)
        committed = await committed_answers(broker, names, BULK + 2 * URGENT)
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        w.kill()
    answered_once(*committed)


def processes(w: WorkerProcess, own: bool) -> list[WorkerProcess]:
    """``run``'s member processes, seen through their metrics: with the urgent
    lane in its own process, that one is member 1 (port + 1)."""
    return [w, WorkerProcess(w.proc, w.metrics_port + 1, w.log_path)] if own else [w]


async def produce_urgent(broker: Broker, urgent: str, first: int) -> None:
    """URGENT urgent requests from number ``first``, spread over ~0.1 s."""
    await produce_all(
        broker.bootstrap,
        urgent,
        [(f"u{i}".encode(), request(100_000 + i)) for i in range(first, first + URGENT)],
        partition_of=lambda i: i % PARTS,
        rate=URGENT / 0.1,
    )


def _urgent_fetch(w: WorkerProcess) -> float:
    """Urgent partitions the worker reads on the urgent lane's own connection."""
    try:
        return w.metrics().get("infer_lane_urgent_fetch_partitions", 0.0)
    except OSError:
        return 0.0


async def test_urgent_partitions_move_between_members_and_nothing_is_lost(
    broker: Broker, names: dict[str, str]
) -> None:
    """The urgent lane's partitions are read by a consumer of their own
    (``worker.kafka.urgentfetch``): handed over once positioned, taken back when
    a revocation begins. A member joining while urgent requests stream in takes
    half of them: each member's fetcher then holds its own one, and every
    request of both lanes is answered."""
    urgent, bulk = await _backlog(broker, names)
    async with members(broker, names) as (answers, workers):
        w1 = workers.start()
        await wait_assigned([w1], 2 * PARTS)
        await until(lambda: _urgent_fetch(w1) == PARTS, 30, "urgent partitions handed over")
        streaming = asyncio.create_task(
            produce_all(
                broker.bootstrap,
                urgent,
                [(f"u{i}".encode(), request(100_000 + i)) for i in range(10 * URGENT)],
                partition_of=lambda i: i % PARTS,
                rate=10 * URGENT / 4.0,  # over the rebalance, ~4 s
            )
        )
        w2 = workers.start()
        await wait_assigned([w1, w2], 2 * PARTS)
        await streaming
        held = lambda: (_urgent_fetch(w1), _urgent_fetch(w2))  # noqa: E731
        await until(lambda: held() == (1.0, 1.0), 30, f"one urgent partition each: {held()}")
        done = lambda: by_topic(answers.collector)  # noqa: E731
        await until(
            lambda: done()[bulk] >= BULK and done()[urgent] >= 10 * URGENT, 120, "all answered"
        )
        for w in (w1, w2):
            assert w.terminate() == 0, w.log_tail()
            no_crash_in_log(w)
