"""Faults only a replicated cluster has (Apache Kafka only): three KRaft brokers,
topics with replication factor 3 and ``min.insync.replicas = 2``, the worker
producing with ``acks=all`` (it always does).

- SIGKILL of the broker that leads the input and output partitions and hosts the
  group's coordinator, mid-stream;
- the whole cluster stopped and started again with its data, mid-backlog;
- that broker SIGSTOPped for longer than the broker and group session timeouts,
  then SIGCONTed.

One cluster serves the module (it starts in about 10 s on two cores); each test
leaves every node running again. How soon leadership moves is the broker's
``broker.session.timeout.ms``, 3 s in the tests (``TEST_SETTINGS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterator

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from devkit.apache_kafka import KafkaCluster
from tests.conftest import require_kafka
from worker.ops.processes import WorkerProcess
from worker.ops.topics import Produced, committed_offsets, end_offsets, produce_all

from .conftest import (
    Answers,
    no_crash_in_log,
    record_scenario,
    request,
    start,
    verify_topics,
    wait_assigned,
    wait_ready,
)

pytestmark = pytest.mark.faults

NODES = (1, 2, 3)
# A request timeout shorter than a failover (about broker.session.timeout.ms), so
# that the worker's acknowledgements are overdue and it says so (/ready 503).
WORKER = {
    "INFER_WORKER_KAFKA__REQUEST_TIMEOUT_MS": "1500",
    "INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS": "256",
    "INFER_WORKER_KAFKA__MAX_POLL_RECORDS": "100",
}
WINDOW = 256 + 100  # what one member can have read and not committed


@pytest.fixture(scope="module")
def cluster() -> Iterator[KafkaCluster]:
    require_kafka()
    with KafkaCluster(3) as c:
        yield c


@pytest.fixture
def kafka3(cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The module's cluster, every node running again after the test."""
    yield cluster
    for node in NODES:
        with contextlib.suppress(Exception):
            cluster.resume(node)
    cluster.start_node(*NODES)


async def coordinator_of(cluster: KafkaCluster, group: str) -> int:
    """The node that coordinates ``group`` (the leader of its offsets partition)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:
        return int(await admin.find_coordinator(group))
    finally:
        await admin.close()


async def replicated_topics(
    cluster: KafkaCluster, names: dict[str, str], leader: int, input_leader: int | None = None
) -> None:
    """The test's topics, each partition on all three brokers with ``leader``
    first (its preferred leader; ``input_leader`` for the input topic's), and
    ``min.insync.replicas = 2``."""
    topics = ((names["requests"], 2), (names["results"], 2), (names["dlq"], 1))
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:
        for topic, count in topics:
            first = input_leader if input_leader and topic == names["requests"] else leader
            replicas = [first, *(n for n in NODES if n != first)]
            new = NewTopic(
                topic,
                num_partitions=-1,
                replication_factor=-1,
                replica_assignments={p: replicas for p in range(count)},
                topic_configs={"min.insync.replicas": "2"},
            )
            with contextlib.suppress(TopicAlreadyExistsError):
                response = await admin.create_topics([new])
                assert all(e[1] == 0 for e in response.topic_errors), response
        for _ in range(500):  # leaders are elected after CreateTopics returns
            described = await admin.describe_topics([t for t, _ in topics])
            leaders = {t["topic"]: {p["leader"] for p in t["partitions"]} for t in described}
            wanted = {t: {input_leader or leader} for t, _ in topics[:1]}
            wanted |= {t: {leader} for t, _ in topics[1:]}
            if leaders == wanted:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"leaders not as asked: {described}")
    finally:
        await admin.close()


class Watch:
    """Samples a worker's metrics in the background: whether it is ready, and how
    many answers the broker has acknowledged (the worker's own view, unlike a
    test reader's, which a paused leader stalls too)."""

    def __init__(self, w: WorkerProcess) -> None:
        self.w = w
        self.samples: list[tuple[float, bool, float]] = []  # (when, ready, acknowledged)
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                m = await asyncio.to_thread(self.w.metrics)
                acked = m.get('infer_results_produced_total{status="ok"}', 0.0)
                self.samples.append((time.monotonic(), m.get("infer_ready") == 1.0, acked))
            await asyncio.sleep(0.05)

    def not_ready_seconds(self) -> float:
        pairs = itertools.pairwise(self.samples)
        return sum(b[0] - a[0] for a, b in pairs if not a[1])

    def resumed_after(self, since: float) -> float:
        """Seconds from ``since`` until acknowledged answers moved again after
        their longest standstill."""
        points = [(t, n) for t, _, n in self.samples if t >= since]
        moved = [since, *(b[0] for a, b in itertools.pairwise(points) if b[1] != a[1])]
        gaps = [(b - a, b) for a, b in itertools.pairwise(moved)]
        return max(gaps)[1] - since if gaps else 0.0

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def all_requests_answered(
    cluster: KafkaCluster, names: dict[str, str], answers: Answers, timeout: float
) -> None:
    """Until every record of the input topic is answered. Counted from the
    input's end offsets, not from what the test sent: a send the test producer
    retried across a leader change may have been written twice, and both copies
    are requests."""
    ends = await end_offsets(cluster.bootstrap, [names["requests"]])
    await answers.wait_for(sum(ends.values()), timeout)


async def offsets_at_least(
    cluster: KafkaCluster, names: dict[str, str], floor: dict[int, int], timeout: float = 30.0
) -> dict[int, int]:
    """The group's committed offsets once each is at least ``floor``'s. Asked
    again, not once: while the group coordinator loads its partition after a
    restart, Kafka answers OffsetFetch with COORDINATOR_LOAD_IN_PROGRESS and no
    partitions, which aiokafka's ``committed()`` (it ignores that group-level
    error) reports as "no committed offset" (seen 0.1-0.2 s after the restart)."""
    deadline = time.monotonic() + timeout
    while True:
        now = await committed_offsets(cluster.bootstrap, names["group"], names["requests"], 2)
        if all(now[p] >= floor[p] for p in floor) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


def stream(
    cluster: KafkaCluster, names: dict[str, str], n: int, rate: float
) -> asyncio.Task[list[Produced]]:
    """``n`` requests produced at ``rate`` a second over both input partitions,
    in the background, while the test injects its fault."""
    records = [(None, request(i)) for i in range(n)]
    sending = produce_all(
        cluster.bootstrap, names["requests"], records, partition_of=lambda i: i % 2, rate=rate
    )
    return asyncio.create_task(sending)


def assert_all_ok(answers: Answers, names: dict[str, str]) -> None:
    """Every answer a result of status ok: none replaced by an error because the
    broker seemed to refuse it (what a send that timed out during a failover
    became, before that was fixed)."""
    results = [r.result() for r in answers.collector.records[names["results"]]]
    bad = [(r.source, r.error) for r in results if r.status != "ok"]
    assert not bad and not answers.collector.records[names["dlq"]], bad[:5]


async def test_sigkill_of_the_leader_and_coordinator_loses_nothing(
    kafka3: KafkaCluster, names: dict[str, str]
) -> None:
    victim = await coordinator_of(kafka3, names["group"])
    await replicated_topics(kafka3, names, leader=victim)
    n = 3000
    w = start(kafka3, names, **WORKER)
    answers = await Answers.start(kafka3, names)
    watch = Watch(w)
    try:
        await wait_assigned([w], 2)
        producing = stream(kafka3, names, n, rate=400)
        await answers.wait_for(n // 4, 60)
        kafka3.kill(victim)  # leader of every input and output partition, and coordinator
        killed_at = time.monotonic()
        await producing
        await all_requests_answered(kafka3, names, answers, 120)
        await wait_ready(w, 200, 30)
        await watch.stop()
        recovery, not_ready = watch.resumed_after(killed_at), watch.not_ready_seconds()
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        await watch.stop()
        w.kill()
        await answers.stop()
    report = await verify_topics(kafka3, names, seen=answers)
    record_scenario(
        "3 brokers: SIGKILL of the partitions' leader (and group coordinator)",
        report,
        round(recovery, 2),
        not_ready_s=round(not_ready, 2),
    )
    assert report.totals.lost == 0, report.format()
    assert report.totals.surplus_answers <= WINDOW, report.format()
    assert_all_ok(answers, names)
    # Not ready while its acknowledgements were overdue, ready again by itself.
    assert not_ready > 0, "the worker never reported not-ready during the failover"


async def test_whole_cluster_restart_resumes_at_the_committed_offsets(
    kafka3: KafkaCluster, names: dict[str, str]
) -> None:
    await replicated_topics(kafka3, names, leader=1)
    first, second = 3000, 1000
    w = start(kafka3, names, **WORKER)
    answers = await Answers.start(kafka3, names)
    watch = Watch(w)
    try:
        await wait_assigned([w], 2)
        await produce_all(
            kafka3.bootstrap,
            names["requests"],
            [(None, request(i)) for i in range(first)],
            partition_of=lambda i: i % 2,
        )
        await answers.wait_for(first // 3, 60)  # mid-backlog
        before = await committed_offsets(kafka3.bootstrap, names["group"], names["requests"], 2)
        kafka3.stop_node(*NODES)  # all three, data kept
        await wait_ready(w, 503, 30)
        kafka3.start_node(*NODES)
        back_at = time.monotonic()
        after = await offsets_at_least(kafka3, names, before)
        await produce_all(
            kafka3.bootstrap,
            names["requests"],
            [(None, request(i)) for i in range(first, first + second)],
            partition_of=lambda i: i % 2,
        )
        await all_requests_answered(kafka3, names, answers, 120)
        await wait_ready(w, 200, 30)
        await watch.stop()
        recovery = watch.resumed_after(back_at)
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        await watch.stop()
        w.kill()
        await answers.stop()
    report = await verify_topics(kafka3, names, seen=answers)
    record_scenario(
        "3 brokers: whole cluster stopped and restarted mid-backlog (data kept)",
        report,
        round(recovery, 2),
        committed_before=sum(before.values()),
    )
    # The offsets committed before the stop survived it, and the worker went on
    # from them: nothing lost, and what it answered twice is at most what it had
    # read and not yet committed.
    assert sum(before.values()) > 0 and all(after[p] >= before[p] for p in before), (before, after)
    assert report.totals.lost == 0, report.format()
    assert report.totals.surplus_answers <= WINDOW, report.format()
    assert_all_ok(answers, names)


async def test_broker_paused_past_the_session_timeouts_loses_nothing(
    kafka3: KafkaCluster, names: dict[str, str]
) -> None:
    victim = await coordinator_of(kafka3, names["group"])
    # The input's leader is another broker: the test's own producer would stall
    # on a paused leader too, and with it the stream the worker is measured on.
    other = next(n for n in NODES if n != victim)
    await replicated_topics(kafka3, names, leader=victim, input_leader=other)
    n, paused_for = 3000, 8.0  # twice the broker's and the group's 3 s sessions
    w = start(kafka3, names, **WORKER)
    answers = await Answers.start(kafka3, names)
    watch = Watch(w)
    try:
        await wait_assigned([w], 2)
        producing = stream(kafka3, names, n, rate=300)
        await answers.wait_for(n // 4, 60)
        kafka3.pause(victim)
        paused_at = time.monotonic()
        await asyncio.sleep(paused_for)  # the fault's duration itself, not a wait for anything
        kafka3.resume(victim)
        await producing
        await all_requests_answered(kafka3, names, answers, 120)
        await wait_ready(w, 200, 30)
        await watch.stop()
        recovery, not_ready = watch.resumed_after(paused_at), watch.not_ready_seconds()
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        await watch.stop()
        w.kill()
        await answers.stop()
    report = await verify_topics(kafka3, names, seen=answers)
    record_scenario(
        f"3 brokers: output leader and coordinator SIGSTOPped {paused_for:.0f} s, then SIGCONT",
        report,
        round(recovery, 2),
        not_ready_s=round(not_ready, 2),
    )
    assert report.totals.lost == 0, report.format()
    assert report.totals.surplus_answers <= WINDOW, report.format()
    assert_all_ok(answers, names)
