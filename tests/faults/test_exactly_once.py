"""Exactly-once (Apache Kafka only): two workers with
``kafka.processing_guarantee = "exactly-once"``, SIGKILLed and restarted again and
again mid-stream. A read_committed reader must see every request answered once:
nothing lost, nothing twice. The same topic read uncommitted shows what the
transactions kept out (answers in killed workers' open transactions, aborted
when they restarted): how many depends on where the kills fall, 0 to 59 in runs
here, so it is reported, not asserted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess
from worker.ops.topics import Collector, OffsetGaps, produce_all
from worker.ops.verify import check, read_topics

from .conftest import (
    no_crash_in_log,
    reads_more,
    record_scenario,
    request,
    start,
    wait_assigned,
)

pytestmark = pytest.mark.faults

PARTS, N = 4, 6000
EOS = {
    "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
    "INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS": "256",
    "INFER_WORKER_KAFKA__MAX_POLL_RECORDS": "100",
}


def answered(c: Collector, topic: str) -> int:
    return len({(r.result().source.partition, r.result().source.offset) for r in c.records[topic]})


async def results_written(broker: Broker, topic: str) -> int:
    """Every result record on ``topic``, in committed transactions or not: read
    uncommitted until nothing new arrives for 1.5 s (transaction markers leave
    offset gaps, which are not re-read)."""
    c = Collector(broker.bootstrap, [topic], _gaps=OffsetGaps(patience=0.0))
    await c.start()
    try:
        count = -1
        while c.count(topic) > count:
            count = c.count(topic)
            await c.collect(lambda c, seen=count: c.count(topic) > seen, 1.5)
        return count
    finally:
        await c.stop()


async def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_sigkills_and_restarts_answer_every_request_exactly_once(
    broker: Broker, names: dict[str, str]
) -> None:
    await create_topics(
        broker.bootstrap, {names["requests"]: PARTS, names["results"]: PARTS, names["dlq"]: 1}
    )

    def worker(member: str) -> WorkerProcess:
        # The member's transactional id is "<group>.<member>": a restarted member
        # fences (and aborts the open transaction of) the process it replaces.
        return start(broker, names, INFER_WORKER_KAFKA__GROUP_INSTANCE_ID=member, **EOS)

    live = {"w1": worker("w1"), "w2": worker("w2")}
    killed: list[WorkerProcess] = []
    committed = Collector(broker.bootstrap, [names["results"]], isolation_level="read_committed")
    await committed.start()
    reader = asyncio.create_task(committed.collect(lambda _: False, 3600))
    progress = lambda: answered(committed, names["results"])  # noqa: E731
    try:
        await wait_assigned(list(live.values()), PARTS)
        producing = asyncio.create_task(
            produce_all(
                broker.bootstrap,
                names["requests"],
                [(None, request(i)) for i in range(N)],
                partition_of=lambda i: i % PARTS,
                rate=400,
            )
        )
        # Four SIGKILLs, alternating members. The first and third member come back
        # at once (its partitions wait for it: static membership); after the second
        # and fourth, the survivor takes all partitions first, so the dead member's
        # open transaction is still open while the survivor answers the same
        # requests again, until the restart aborts it.
        for round_, member in enumerate(("w1", "w2", "w1", "w2")):
            await until(lambda r=round_: progress() >= (r + 1) * N // 8, 120, "no progress")
            # Then once the victim has read more: killed on what it reads, not on
            # what a reader just saw committed (right after a commit, before the
            # next transaction has written anything).
            await reads_more(live[member], 50, within=5.0)
            victim = live.pop(member)
            victim.kill()
            killed.append(victim)
            if round_ % 2 == 1:
                await wait_assigned(list(live.values()), PARTS)
            live[member] = worker(member)
            await wait_assigned(list(live.values()), PARTS)
        await producing
        await until(lambda: progress() >= N, 180, f"{progress()} of {N} answered")
        for w in live.values():
            assert w.terminate() == 0, w.log_tail()
            no_crash_in_log(w)
    finally:
        for w in [*live.values(), *killed]:
            w.kill()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await committed.stop()
    inputs, seen = await read_topics(
        broker.bootstrap,
        [names["requests"]],
        names["results"],
        names["dlq"],
        idle_timeout=1.5,
        isolation_level="read_committed",
    )
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable, strict=True)
    written = await results_written(broker, names["results"])
    # What an operator runs: infer-worker verify, reading committed transactions.
    cli = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable, "-m", "worker", "verify", "--strict", "--read-committed",
            "--bootstrap-servers", broker.bootstrap, "--input-topics", names["requests"],
            "--output-topic", names["results"], "--dlq-topic", names["dlq"],
            "--idle-timeout", "1.5",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    record_scenario(
        "exactly-once: 2 workers, 4 SIGKILLs and restarts (read_committed)",
        report,
        None,
        results_written=written,
        aborted=written - len(seen.answers),
    )
    assert report.totals.requests == N and report.ok, report.format()
    assert report.totals.lost == 0 and report.totals.surplus_answers == 0, report.format()
    assert cli.returncode == 0 and f"{N} requests, all answered" in cli.stdout, cli.stdout
