"""Crash-loop protection: a record that kills the whole process is answered, not
re-read for ever.

A poison record that crashes the process (a native crash in a decoder or an
engine, an OOM kill) is read again after every restart, by every member it
moves to. Counting attempts in memory cannot help: the memory dies with it. So
each member marks, per partition, where it starts (the committed offset: the
*head*) and releases the mark when it hands the partition over cleanly. A mark
found unreleased means the previous owner died; the crashes counted at the same
head decide what happens:

* no crash: normal batching;
* one or more: *cautious* mode for the next records of that partition: one
  record at a time, each committed before the next is read, so the next crash
  happens with the poison itself at the head. The cautious owner claims the head
  at the crashes it found and counts itself (one more) only when it hands the
  head record on to be run: an owner that dies before that (killed again during
  a rolling restart, or while busy with other partitions) never ran the record,
  and a record is quarantined only for deaths it could have caused (a restart
  loop under load quarantined an innocent record before, 1 run in 3 of
  ``test_member_restarts`` under a CPU hog);
* ``limits.max_crash_attempts`` crashes at the same head: that record is
  *quarantined*: answered on the DLQ (``error.code`` ``crash_loop``, key and value
  unchanged) without running it, and the partition moves on.

The marks live in a small topic (``kafka.crash_guard_topic``; compacted on a real
cluster, keyed by group, topic and partition), not in the offset commit's
metadata string, because the embedded broker drops that string (measured). When
the topic does not exist, protection is off and the worker says so at start.

``decide`` is the pure rule; ``CrashGuard`` does the reading and writing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.deadline import Deadline
from worker.flow.errors import CrashLoop
from worker.flow.messages import Job, TopicPartition
from worker.kafka.clients import topic_partitions
from worker.obs import metrics

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Mark:
    head: int  # the committed offset the owner started from (or last released at)
    claims: int  # owners that started at ``head`` and did not release: 0 = clean


class Mode(Enum):
    """How a new owner reads a partition, given the crashes at its head."""

    BATCHED = "batched"  # no crash there: as usual
    ONE_BY_ONE = "one by one"  # a crash: each record answered and committed alone
    QUARANTINE = "quarantine"  # limits.max_crash_attempts crashes: its head set aside


@dataclass(frozen=True)
class Decision:
    crashes: int  # owners that died with this head uncommitted past
    claims: int  # what this owner writes for itself when it claims the head
    mode: Mode
    # ONE_BY_ONE: the claims it writes once it hands the head record on to be run
    armed: int | None = None


@dataclass(slots=True)
class Guarded:
    """A partition read in a mode other than ``BATCHED`` until its crashes are
    behind it: ``ONE_BY_ONE`` for ``left`` more records, or ``QUARANTINE`` until
    the record at ``head`` is set aside."""

    mode: Mode
    head: int
    left: int = 0
    armed: int | None = None  # written (``CrashGuard.claim``) before the head record runs


def quarantined(job: Job, raw_value: bytes | None, max_crashes: int) -> Job:
    """``job`` set aside without running it: the record at the head of its
    partition when ``max_crashes`` worker processes died (answered as
    ``crash_loop``, its original bytes to the DLQ)."""
    return msgspec.structs.replace(
        job, request=None, inputs={}, raw_value=raw_value,
        failure=CrashLoop(
            f"worker processes died {max_crashes} times with this record at "
            "the head of its partition; not run again (limits.max_crash_attempts)"
        ),
    )  # fmt: skip


def decide(previous: Mark | None, head: int, max_crashes: int) -> Decision:
    """The rule (pure). An unreleased mark at the same head counts its claims as
    crashes there; an unreleased mark at an older head means its owner died
    after committing up to ``head``: one crash at ``head``. A batched owner
    counts itself from its claim (any death of it makes the next owner
    cautious, which costs only speed); a cautious one from handing the head
    record on (``Decision.armed``), since a quarantine answers the record with
    an error."""
    if previous is None or previous.claims == 0:
        crashes = 0
    elif previous.head == head:
        crashes = previous.claims
    else:
        crashes = 1
    if max_crashes > 0 and crashes >= max_crashes:
        return Decision(crashes=crashes, claims=crashes + 1, mode=Mode.QUARANTINE)
    if crashes >= 1:
        # Counted only once the head record is handed on to run (``Guarded.armed``).
        return Decision(crashes=crashes, claims=crashes, mode=Mode.ONE_BY_ONE, armed=crashes + 1)
    return Decision(crashes=0, claims=1, mode=Mode.BATCHED)


def _key(group: str, tp: TopicPartition) -> bytes:
    return f"{group}/{tp.topic}/{tp.partition}".encode()


class MarkSender(Protocol):
    """Where marks are written: the result writer (``AtLeastOnceWriter.send_and_wait``),
    whose producer may be replaced while the guard lives."""

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> Any: ...


class CrashGuard:
    def __init__(
        self,
        connection: Mapping[str, Any],
        topic: str,
        group: str,
        producer: MarkSender,
    ) -> None:
        """``connection``: aiokafka bootstrap and security arguments (the guard
        reads its topic with a consumer of its own, on the same cluster)."""
        self._connection = dict(connection)
        self._topic = topic
        self._group = group
        self._producer = producer
        self._claimed: dict[TopicPartition, int] = {}

    async def claim_heads(
        self, heads: Mapping[TopicPartition, int], max_crashes: int, window: int
    ) -> dict[TopicPartition, Guarded]:
        """Claim each partition at its head, and say how to read those a previous
        owner died in: quarantine the head record, or one record at a time over
        ``window`` (what a dead batch could hold)."""
        marks = await self.read(heads)
        guarded: dict[TopicPartition, Guarded] = {}
        for tp, head in heads.items():
            d = decide(marks.get(tp), head, max_crashes)
            await self.claim(tp, head, d.claims)
            where = f"{tp.topic}:{tp.partition}@{head}"
            if d.mode is Mode.QUARANTINE:
                guarded[tp] = Guarded(d.mode, head)
                metrics.CRASH_LOOPS.inc()
                log.error("crash_loop_quarantine", record=where, crashes=d.crashes)
            elif d.mode is Mode.ONE_BY_ONE:
                guarded[tp] = Guarded(d.mode, head, left=window, armed=d.armed)
                log.warning("crash_suspected", head=where, crashes=d.crashes, mode=d.mode.value)
        return guarded

    async def read(
        self, tps: Iterable[TopicPartition], timeout: float = 10.0
    ) -> dict[TopicPartition, Mark]:
        """The latest mark of each of ``tps`` (reads the guard topic from its
        beginning without a group: it holds one live key per partition)."""
        wanted = {_key(self._group, tp): tp for tp in tps}
        found: dict[TopicPartition, Mark] = {}
        consumer = AIOKafkaConsumer(**self._connection, enable_auto_commit=False)
        await consumer.start()
        try:
            parts = await topic_partitions(consumer, self._topic)
            ktps = [KafkaTP(self._topic, p) for p in parts]
            consumer.assign(ktps)
            await consumer.seek_to_beginning(*ktps)
            budget = Deadline(timeout)
            while not budget.expired:
                fetched = await consumer.getmany(timeout_ms=200)
                for records in fetched.values():
                    for record in records:
                        tp = wanted.get(record.key or b"")
                        if tp is not None and record.value:
                            found[tp] = _parse(record.value)
                ends = [await _at_end(consumer, k) for k in ktps]
                if all(ends):
                    break
        finally:
            await consumer.stop()
        return found

    async def claim(self, tp: TopicPartition, head: int, claims: int) -> None:
        self._claimed[tp] = head
        await self._write(tp, Mark(head, claims))

    async def release(self, heads: dict[TopicPartition, int | None], timeout: float) -> None:
        """Clean hand-over: claims back to 0 at the head reached, within ``timeout``
        in all (best effort: a release that cannot be written counts as one crash
        later, which only makes the next owner cautious for a while)."""
        marks = {}
        for tp, head in heads.items():
            start = self._claimed.pop(tp, None)
            at = head if head is not None else start
            if at is not None:
                marks[tp] = Mark(at, 0)
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._write(tp, m) for tp, m in marks.items())), timeout
            )
        except (KafkaError, TimeoutError) as exc:
            log.warning("crash_guard_release_failed", partitions=len(marks), error=repr(exc))

    @property
    def claimed(self) -> list[TopicPartition]:
        return list(self._claimed)

    async def _write(self, tp: TopicPartition, mark: Mark) -> None:
        value = json.dumps({"head": mark.head, "claims": mark.claims}).encode()
        await self._producer.send_and_wait(self._topic, value, key=_key(self._group, tp))


async def _at_end(consumer: AIOKafkaConsumer, tp: KafkaTP) -> bool:
    high = consumer.highwater(tp)
    return high is not None and await consumer.position(tp) >= high


def _parse(value: bytes) -> Mark:
    try:
        doc: Any = json.loads(value)
        return Mark(int(doc["head"]), int(doc["claims"]))
    except (ValueError, KeyError, TypeError):
        return Mark(-1, 0)  # not ours or corrupt: treated as clean
