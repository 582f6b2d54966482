"""ExactlyOnceWriter: exactly-once. The results, the DLQ records and the input
offsets they answer are committed together, in one Kafka transaction.

Each cycle takes the next completed batch and those that completed behind it
(at most ``kafka.transaction_batches``; a cycle never waits for more), and:

    begin -> send every record -> await every acknowledgement
          -> [an earlier offset still unanswered? keep the transaction open]
          -> group lease confirmed -> send_offsets_to_transaction(watermarks)
          -> commit_transaction -> mark the offsets done and committed

This is the one place where flush, produce and commit are ordered under
exactly-once (``at_least_once`` and ``commit.Committer`` order them under
at-least-once). Answers reach the writer only after their device-to-host copy, so
a transaction never holds a result that was not computed. A transaction stays
open while a partition has a gap below its answers (batches complete out of
offset order): committing then would leave answers above the committed offset,
which the next owner would answer again. Anything that fails inside a
transaction aborts it (a refused record becomes its small fallback, as under
at-least-once), and everything it held is sent again in the next one; a
revocation aborts an open transaction that holds answers of the revoked
partitions (``fence``). ``ProducerFenced`` means another process took this
member's transactional id, a restarted instance of this member: this one is a
zombie and stops (exit 1).

What aiokafka's transactional producer does on the wire (0.12 to 0.14):
InitProducerId, AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit and EndTxn,
all at version 0. TxnOffsetCommit v0 carries the group id only, no member id or
generation (KIP-447), so the group coordinator cannot refuse a zombie's offsets;
``worker.kafka.lease`` closes most of that gap (see there). Apache Kafka
4.x still serves these versions, and a cluster formatted with
``transaction.version=2`` (KIP-890, Kafka 4.4's default) serves them with the
older transaction protocol (no epoch bump per transaction).
"""

from __future__ import annotations

import asyncio

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, ProducerFenced
from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.errors import TransactionFenced
from worker.flow.messages import Completed, TopicPartition
from worker.flow.streams import Woken
from worker.kafka.clients import start_transactional_producer, transactional_id
from worker.kafka.delivery.answers import Answers
from worker.kafka.delivery.decide import Action
from worker.kafka.delivery.outgoing import OutRecord
from worker.kafka.delivery.producing import ProducerFactory, Producing
from worker.kafka.delivery.transaction import Txn, TxnState
from worker.kafka.delivery.writer import Completions, WriterParts
from worker.kafka.lease import GroupLease
from worker.kafka.topiccheck import MissingTopics
from worker.obs import metrics

log = structlog.get_logger(__name__)


class _Failed(Exception):
    """A transaction cannot be committed; ``refused`` maps records the broker
    refused (by ``id``) to why."""

    def __init__(self, reason: str, refused: dict[int, BaseException] | None = None) -> None:
        super().__init__(reason)
        self.refused = refused or {}


class ExactlyOnceWriter:
    """Sends answers and commits them with their offsets, one transaction per
    group of completed batches (see the module's docstring)."""

    def __init__(
        self,
        parts: WriterParts,
        lease: GroupLease,
        max_batches: int,
        producer_factory: ProducerFactory = start_transactional_producer,
    ) -> None:
        self._producing = Producing(parts.kafka, producer_factory)
        self._answers = Answers(parts)
        self._batches = Completions(parts.completed_in)
        self._committer, self._tracker, self._kafka = parts.committer, parts.tracker, parts.kafka
        self._lease = lease
        self._max_batches = max(1, max_batches)
        self._lock = asyncio.Lock()  # one transaction at a time: cycles, marks, fences
        self._txn = TxnState()
        self._open: list[OutRecord] = []  # sent in the open transaction (or being sent)
        self._retry: list[OutRecord] = []  # to send again: their transaction was aborted
        self._wake = asyncio.Event()  # records wait in _retry (after a fence)
        self._held: asyncio.Future[Completed] | None = None  # taken, not yet completed
        self._backoff = self._producing.backoff()
        self._missing = MissingTopics(parts.kafka)  # a topic gone: one line, not one a record
        # Send each record in a record batch of its own until the next commit: some
        # were refused together with their neighbours (decide: RESEND_ALONE).
        self._alone = False

    # --- the state ---------------------------------------------------------------------

    @property
    def state(self) -> Txn:
        return self._txn.state

    @property
    def _in_txn(self) -> bool:
        return self._txn.open

    def _to(self, state: Txn) -> None:
        """Move the transaction's state (checked); delivery is not ready from a
        failure until a transaction commits again."""
        before = self._txn.to(state)
        failing = (Txn.FAILED, Txn.RETRYING)
        if state is Txn.FAILED and before not in failing:
            metrics.set_condition("delivery", False)
        elif state is Txn.READY and before is Txn.RETRYING:
            metrics.set_condition("delivery", True)
            log.info("delivery_recovered")

    async def _begin(self) -> None:
        assert self.producer is not None, "start() first"
        await self.producer.begin_transaction()
        self._to(Txn.RETRYING if self._txn.state is Txn.FAILED else Txn.OPEN)

    @property
    def producer(self) -> AIOKafkaProducer | None:
        return self._producing.producer

    async def existing_topics(self) -> set[str]:
        return await self._producing.existing_topics()

    async def start(self) -> None:
        await self._producing.start()
        log.info("transactions_on", transactional_id=transactional_id(self._kafka))

    # --- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        more = True
        while more or self._retry:
            batches: list[Completed] = []
            if more:
                batches, more = await self._take()
            outs = [out for completed in batches for out in self._answers.records(completed)]
            async with self._lock:
                ok = await self._cycle(outs, final=not more)
            if not ok:  # backed off outside the lock: a revocation may need it
                await asyncio.sleep(self._backoff.next())

    async def _take(self) -> tuple[list[Completed], bool]:
        """Completed batches for the next transaction: the next one (waited for,
        unless records already wait to be sent again) and those completed behind
        it; and False once the stream has ended."""
        batches: list[Completed] = []
        while len(batches) < self._max_batches:
            busy = bool(batches or self._retry)
            fut, self._held = self._held, None
            if fut is None:
                if busy and self._batches.queue.empty():
                    break
                item = await self._batches.next_or_woken(self._wake)
                if item is Woken.WOKEN:  # records wait to be sent again
                    break
                if item is None:
                    return batches, False
                fut = item
            if busy and not fut.done():
                self._held = fut  # the next transaction's: not waited for now
                break
            batches.append(await self._batches.completed(fut))
        return batches, True

    # --- one transaction --------------------------------------------------------------

    async def _cycle(self, new: list[OutRecord], final: bool) -> bool:
        """Send ``new`` and the records waiting to be sent again in the open
        transaction, and commit it unless a gap keeps it open. False when it was
        aborted (what it held waits in ``_retry``) or could not begin."""
        todo = [o for o in (*self._retry, *new) if self._owned(o)]
        self._retry = []
        if self._txn.state is Txn.FAILED and todo and not await self._lease.held():
            self._retry = todo  # not a member now: sending would only be aborted again
            return False
        try:
            await self._send_all(todo)
            if not self._open and not self._in_txn:
                return True  # nothing to commit (every answer was stale)
            if not all(self._owned(o) for o in self._open):
                raise _Failed("partitions revoked or reset under the open transaction")
            offsets, complete = self._tracker.watermarks_with(
                (o.job.tp, o.job.offset, o.job.epoch) for o in self._open
            )
            if not complete and not final:
                return True  # the gap's answers come in a later batch
            if not complete:
                # Cannot happen after a full drain (every record read was answered);
                # after a cut-short one, the group reads these records again.
                await self._abort(_Failed("offsets unanswered at the end of the stream"))
                self._retry = []
                return True
            if not await self._lease.held():
                raise _Failed("group membership not confirmed (expelled, or rejoining)")
            await self._commit(offsets)
        except ProducerFenced as exc:
            self._to(Txn.FENCED)
            raise TransactionFenced(
                f"transactional id {transactional_id(self._kafka)!r} was taken by another "
                "process (a restarted instance of this member): this one stops"
            ) from exc
        except (_Failed, KafkaError) as exc:
            await self._abort(exc)
            return False
        return True

    def _owned(self, out: OutRecord) -> bool:
        job = out.job
        return self._tracker.owns(job.tp, job.offset, job.epoch)

    async def _send_all(self, outs: list[OutRecord]) -> None:
        """Send ``outs`` in the open transaction (begun if none is) and await
        their acknowledgements. They join ``_open`` first, so that whatever
        fails from here on, an abort finds them to send again."""
        if not outs:
            return
        assert self.producer is not None, "start() first"
        self._open += outs
        if not self._in_txn:
            await self._begin()
        if self._alone:
            sent = [pair for out in outs for pair in await self._producing.send_grouped([out])]
        else:
            sent = await self._producing.send_grouped(outs)
        failed = await self._producing.failures(sent, caught=(KafkaError,), fatal=(ProducerFenced,))
        refused = {id(out): failed[id(ack)] for out, ack in sent if id(ack) in failed}
        if refused:
            first = next(iter(refused.values()))
            raise _Failed(f"{len(refused)} records not acknowledged: {first!r}", refused)

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        assert self.producer is not None
        moved = {tp: off for tp, off in offsets.items() if self._tracker.committed(tp) != off}
        if moved:
            await self.producer.send_offsets_to_transaction(
                {KafkaTP(tp.topic, tp.partition): off for tp, off in moved.items()},
                self._kafka.group_id,
            )
        await self._producing.watched(self.producer.commit_transaction())
        self._to(Txn.FAILED if self._retry else Txn.READY)
        committed, self._open = self._open, []
        self._alone = False
        self._answers.acknowledged(committed)
        if moved:
            self._committer.record(moved)
        self._committer.notify()
        metrics.TRANSACTIONS.labels(outcome="committed").inc()
        self._missing.delivered()
        self._backoff.reset()

    async def _abort(self, exc: BaseException) -> None:
        """End the open transaction without its records, and queue what ``decide``
        says is sent instead (the same records, each alone, or fallbacks)."""
        refused = exc.refused if isinstance(exc, _Failed) else {}
        failed = [(o, refused.get(id(o)), self._alone) for o in self._open]
        todo = self._answers.next_attempts(failed, self._producing.idempotent)
        redo = [record for record, _ in todo]
        renew = any(verdict.renew for _, verdict in todo)
        alone = any(verdict.action is Action.RESEND_ALONE for _, verdict in todo)
        gone = {o.topic for o, failure, _ in failed if self._missing.refused(o.topic, failure)}
        self._open = []
        self._alone = self._alone or alone
        log.warning("transaction_aborted", reason=str(exc) or repr(exc), records=len(redo),
                    missing_topics=sorted(gone))  # fmt: skip
        metrics.TRANSACTIONS.labels(outcome="aborted").inc()
        # Not ready from now: the abort below can take up to the request timeout,
        # and the state says FAILED only after it.
        metrics.set_condition("delivery", False)
        await self._end_open("a record was refused for good" if renew else None)
        self._to(Txn.FAILED)
        self._retry = redo

    async def _end_open(self, renew: str | None = None) -> None:
        """Abort the open transaction, or (for the reason ``renew``, or when the
        abort fails) replace the producer: a new one's InitProducerId aborts
        whatever the old one left open, and starts its sequences again."""
        assert self.producer is not None
        was_open = self._in_txn
        if was_open and renew is None:
            try:
                await asyncio.wait_for(self.producer.abort_transaction(), self._producing.overdue_s)
            except ProducerFenced:
                self._to(Txn.FENCED)
                raise
            except (KafkaError, TimeoutError, AssertionError) as exc:
                # aiokafka asserts its state transitions: after a failed commit
                # an abort can be one it refuses.
                log.warning("transaction_abort_failed", error=repr(exc))
                renew = "the abort failed"
        if was_open:  # closed: a revocation's abort keeps a failure's state
            self._to(Txn.FAILED if self._txn.state is Txn.RETRYING else Txn.READY)
        if renew is not None:
            await self._producing.replace(renew)

    # --- callers outside the loop -----------------------------------------------------

    async def fence(self, revoked: set[TopicPartition]) -> None:
        """Called on revocation (``Committer.settle_revoked``), just before the
        revoked partitions are forgotten: an open transaction holding answers of
        theirs is aborted, since their new owner answers them from the committed
        offsets; its other records are sent again in the next transaction. Then
        waits until the group coordinator answers the offsets this member
        committed for them: a transaction's offsets become visible only once its
        markers are written, after commit_transaction returned, and aiokafka's
        OffsetFetch cannot ask to wait for them (``require_stable``, KIP-447),
        so a new owner that looked too early would answer them again."""
        async with self._lock:
            held = [*self._open, *self._retry]
            if any(o.job.tp in revoked for o in held):
                if self._open:
                    metrics.TRANSACTIONS.labels(outcome="aborted").inc()
                    log.info("transaction_aborted", reason="partitions revoked", records=0)
                self._open = []
                await self._end_open()
                self._retry = sorted((o for o in held if o.job.tp not in revoked), key=seq)
                if self._retry:
                    self._wake.set()
            committed = {tp: self._tracker.committed(tp) for tp in revoked}
            await self._lease.offsets_visible(
                {tp: off for tp, off in committed.items() if off is not None}
            )
        # No suspension point from here to the caller's forget(): the next cycle
        # cannot start before the revoked partitions are forgotten.

    async def send_and_wait(self, topic: str, value: bytes, key: bytes) -> object:
        """A crash-guard mark: a transactional producer sends nothing outside a
        transaction, so it goes in the open one, or in one of its own."""
        assert self.producer is not None, "start() first"
        async with self._lock:
            own = not self._in_txn
            if own:
                await self._begin()
            try:
                meta = await self._producing.watched(
                    await self.producer.send(topic, value, key=key)
                )
                if own:
                    await self._producing.watched(self.producer.commit_transaction())
                    self._to(Txn.FAILED if self._retry else Txn.READY)
            except KafkaError:
                if own:
                    await self._end_open()
                raise
            return meta

    async def close(self) -> None:
        """Abort an open transaction first: read_committed readers of the
        partitions it wrote to would otherwise wait for it to time out."""
        if self.producer is not None and self._in_txn:
            try:
                await asyncio.wait_for(self.producer.abort_transaction(), self._producing.overdue_s)
            except Exception as exc:  # boundary: closing; the broker times it out otherwise
                log.warning("transaction_abort_failed", error=repr(exc))
            self._to(Txn.FAILED if self._txn.state is Txn.RETRYING else Txn.READY)
        await self._producing.close()


def seq(out: OutRecord) -> int:
    return out.seq
