"""Helpers for fault tests: real worker processes against the real brokers."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from devkit.apache_kafka import KafkaCluster
from devkit.kafka_pki import Pki, make_pki
from devkit.kafka_security import Security
from tests.conftest import require_kafka
from worker.contract import Request, Tensor, encode_request
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, end_offsets
from worker.ops.verify import InputRecord, Reply, Report, check, read_topics

# Short group timeouts keep rebalances (about session/2 on this broker) fast.
FAST_GROUP = {
    "INFER_WORKER_KAFKA__SESSION_TIMEOUT_MS": "3000",
    "INFER_WORKER_KAFKA__HEARTBEAT_INTERVAL_MS": "300",
}


def request(i: int, size: int = 8, corner: int | None = None) -> bytes:
    img = np.random.default_rng(i).integers(0, 200, (size, size, 1), dtype=np.uint8)
    if corner is not None:
        img[0, 0, 0] = corner
    return encode_request(
        Request(v=1, id=f"req-{i}", inputs={"image": Tensor.from_numpy(img)}, meta={"i": i})
    )


def start(broker: Broker, names: Mapping[str, str], **env: str) -> WorkerProcess:
    return spawn_worker(
        broker.bootstrap,
        input_topics=[names["requests"]],
        output_topic=names["results"],
        dlq_topic=names["dlq"],
        group_id=names["group"],
        extra_env={**FAST_GROUP, **env},
    )


async def wait_assigned(
    workers: Sequence[WorkerProcess], partitions: int, timeout: float = 60.0
) -> None:
    """Until the live workers own all partitions between them, each at least one."""

    def settled() -> bool:
        counts = [w.metrics().get("infer_assigned_partitions", 0) for w in workers]
        return sum(counts) == partitions and min(counts) >= 1

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in workers:
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.pid} exited:\n{w.log_tail()}")
        try:
            if await asyncio.to_thread(settled):
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError("partitions not assigned to all workers")


def distinct_sources(c: Collector) -> int:
    seen = set()
    for recs in c.records.values():
        for r in recs:
            if "source.offset" in r.headers:
                seen.add((int(r.headers["source.partition"]), int(r.headers["source.offset"])))
            else:
                s = r.result().source
                seen.add((s.partition, s.offset))
    return len(seen)


@dataclass
class Answers:
    """A background reader of the result and DLQ topics."""

    collector: Collector
    task: asyncio.Task[bool]

    @classmethod
    async def start(cls, broker: Broker, names: Mapping[str, str]) -> Answers:
        c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
        await c.start()
        return cls(c, asyncio.create_task(c.collect(lambda _: False, 3600)))

    async def wait_for(self, n: int, timeout: float) -> float:
        """Until ``n`` distinct requests are answered; returns the seconds it took."""
        t0 = time.monotonic()
        while distinct_sources(self.collector) < n:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{distinct_sources(self.collector)} of {n} answered")
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.collector.stop()


async def verify_topics(
    broker: Broker,
    names: Mapping[str, str],
    *,
    strict: bool = False,
    seen: Answers | None = None,
) -> Report:
    """Verify from a fresh read of the topics. On the embedded broker it is united
    with what the test's live reader saw (``seen``): under concurrent producers
    Tansu can hand a reader a partition's batches out of order, and the reader
    then skips the earlier one; an answer seen by either read exists on the
    broker, and the same output record read twice counts once. Kafka needs no
    such help, and answers ``end_offsets`` truly: there the fresh read alone
    must have reached the end of every partition it read."""
    topics = [names["requests"], names["results"], names["dlq"]]
    inputs, observed = await read_topics(
        broker.bootstrap, topics[:1], topics[1], topics[2], idle_timeout=1.5
    )
    assert observed.complete
    answers = {(a.kind, a.output_partition, a.output_offset): a for a in observed.answers}
    if broker.kind == "kafka":
        ends = await end_offsets(broker.bootstrap, topics)
        for p, offsets in inputs[names["requests"]].items():
            assert len(offsets) == ends[(names["requests"], p)], (p, len(offsets), ends)
        written = sum(v for (t, _), v in ends.items() if t != names["requests"])
        assert len(answers) + len(observed.unparseable) == written, (len(answers), ends)
    elif seen is not None:
        kinds: tuple[tuple[str, Literal["result", "dlq"]], ...] = (
            (names["results"], "result"),
            (names["dlq"], "dlq"),
        )
        for topic, kind in kinds:
            for rec in seen.collector.records.get(topic, []):
                if kind == "dlq":
                    h = rec.headers
                    source = InputRecord(
                        h["source.topic"].decode(),
                        int(h["source.partition"]),
                        int(h["source.offset"]),
                    )
                else:
                    src = rec.result().source
                    source = InputRecord(src.topic, src.partition, src.offset)
                answers.setdefault(
                    (kind, rec.partition, rec.offset),
                    Reply(source, rec.partition, rec.offset, kind),
                )
    return check(inputs, list(answers.values()), unparseable=observed.unparseable, strict=strict)


def record_scenario(
    scenario: str, report: Report, recovery_s: float | None, **extra: object
) -> None:
    """Append a line for BENCHMARKS.md when FAULT_REPORT names a file."""
    path = os.environ.get("FAULT_REPORT")
    if not path:
        return
    t = report.totals
    row = {
        "scenario": scenario,
        "sent": t.requests,
        "lost": t.lost,
        "duplicated": t.surplus_answers,
        "recovery_s": recovery_s,
        **extra,
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def ready(w: WorkerProcess) -> int:
    """The worker's /ready status code."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/ready", timeout=1) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def wait_ready(w: WorkerProcess, code: int, timeout: float) -> float:
    """Until /ready answers ``code``; returns the seconds it took."""
    t0 = time.monotonic()
    while await asyncio.to_thread(ready, w) != code:
        assert w.proc.poll() is None, w.log_tail()
        assert time.monotonic() - t0 < timeout, f"/ready never became {code}"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


def no_crash_in_log(w: WorkerProcess) -> None:
    with open(w.log_path, errors="replace") as fh:
        log = fh.read()
    assert "stage_failed" not in log and "Traceback" not in log, w.log_tail(60)


Pred = Callable[[dict[str, float]], bool]


def consumed(w: WorkerProcess) -> float:
    return w.metrics().get("infer_records_consumed_total", 0.0)


async def reads_more(w: WorkerProcess, records: float, within: float) -> None:
    """Until ``w`` has read ``records`` more (or ``within`` seconds passed: this
    only picks the moment of a fault, it is no condition of the test)."""
    deadline = time.monotonic() + within
    start = await asyncio.to_thread(consumed, w)
    while time.monotonic() < deadline:
        if await asyncio.to_thread(consumed, w) >= start + records:
            return
        await asyncio.sleep(0.01)


async def silero_with_changelog(
    broker: Broker, names: Mapping[str, str], parts: int
) -> dict[str, str]:
    """Topics for silero-vad served statefully with a state changelog (input,
    results and changelog of ``parts`` partitions), and the worker settings
    that serve it on them."""
    from tests import real_models
    from tests.integration.test_stateful import STATEFUL

    states = f"{names['requests']}.states"
    await create_topics(broker.bootstrap, {names["requests"]: parts, names["results"]: parts,
                                           names["dlq"]: 1, states: parts})  # fmt: skip
    return {
        **STATEFUL,
        "INFER_WORKER_MODEL__PATH": str(real_models.model_path("silero-vad")),
        "INFER_WORKER_KAFKA__STATE_TOPIC": states,
    }


# A secured Apache Kafka (tests/faults/secured.py), once per session.
@pytest.fixture(scope="session")
def pki() -> Iterator[Pki]:
    with tempfile.TemporaryDirectory(prefix="pki-") as d:
        yield make_pki(Path(d), ("worker", "client"))


@pytest.fixture(scope="session")
def secured(pki: Pki) -> Iterator[KafkaCluster]:
    require_kafka()
    from .secured import CLIENT_PASSWORD, PASSWORD

    users = {"worker": PASSWORD, "client": CLIENT_PASSWORD}
    with KafkaCluster(security=Security(pki, users)) as cluster:
        yield cluster
