"""The one decision of what to send after a failed send (writer.decide), and the
exactly-once writer's transaction states: every case both writers meet, in one
table, so the two can never decide differently again (they used to: the
at-least-once writer fell back a whole refused record batch, the exactly-once
one re-sent its records one by one first)."""

from __future__ import annotations

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnknownProducerId,
)

from worker.flow.messages import Job, TopicPartition
from worker.kafka.delivery.decide import Action, Verdict, decide
from worker.kafka.delivery.outgoing import OutRecord
from worker.kafka.delivery.transaction import MOVES, Txn, TxnState

A = Action
JOB = Job(TopicPartition("in", 0), 5, None, 0.0, None)


def record(fallback: bool = False) -> OutRecord:
    return OutRecord(JOB, "out", b"k", b"v", [], "ok", 1, fallback=fallback)


# (failure, idempotent, shared, alone, is a fallback) -> verdict
CASES = [
    # Not refused: its transaction failed for another reason.
    (None, True, False, False, False, Verdict(A.RESEND, renew=False)),
    # Never written: a broken sequence after a refusal, a leader gone, a timeout.
    (OutOfOrderSequenceNumber(), True, False, False, False, Verdict(A.RESEND, renew=True)),
    (UnknownProducerId(), True, True, False, False, Verdict(A.RESEND, renew=True)),
    (KafkaTimeoutError(), True, True, False, False, Verdict(A.RESEND, renew=False)),
    (KafkaConnectionError(), False, False, False, False, Verdict(A.RESEND, renew=False)),
    # A permission taken away: waited for (an operator grants it again), never a
    # fallback, which the same missing ACL would refuse or divert to the DLQ.
    (TopicAuthorizationFailedError(), True, False, True, False, Verdict(A.RESEND, renew=False)),
    (TransactionalIdAuthorizationFailed(), True, True, False, False, Verdict(A.RESEND, False)),
    # Refused for good with its neighbours: each alone first.
    (MessageSizeTooLargeError(), True, True, False, False, Verdict(A.RESEND_ALONE, renew=True)),
    (MessageSizeTooLargeError(), False, True, False, False,
     Verdict(A.RESEND_ALONE, renew=False)),
    # Refused for good alone: its fallback; a refused fallback: give up.
    (RecordTooLargeError(), True, False, False, False, Verdict(A.FALL_BACK, renew=True)),
    (MessageSizeTooLargeError(), True, True, True, False, Verdict(A.FALL_BACK, renew=True)),
    (RecordTooLargeError(), False, False, False, False, Verdict(A.FALL_BACK, renew=False)),
    (RecordTooLargeError(), True, False, False, True, Verdict(A.GIVE_UP, renew=True)),
]  # fmt: skip


@pytest.mark.parametrize(("failure", "idempotent", "shared", "alone", "fallback", "want"), CASES)
def test_what_is_sent_after_a_failure(
    failure: BaseException | None,
    idempotent: bool,
    shared: bool,
    alone: bool,
    fallback: bool,
    want: Verdict,
) -> None:
    got = decide(record(fallback), failure, idempotent=idempotent, shared=shared, alone=alone)
    assert got == want


ALLOWED = {
    (Txn.READY, Txn.OPEN), (Txn.READY, Txn.FAILED), (Txn.READY, Txn.FENCED),
    (Txn.OPEN, Txn.READY), (Txn.OPEN, Txn.FAILED), (Txn.OPEN, Txn.FENCED),
    (Txn.FAILED, Txn.RETRYING), (Txn.FAILED, Txn.FAILED), (Txn.FAILED, Txn.FENCED),
    (Txn.RETRYING, Txn.READY), (Txn.RETRYING, Txn.FAILED), (Txn.RETRYING, Txn.FENCED),
}  # fmt: skip


@pytest.mark.parametrize("src", list(Txn))
@pytest.mark.parametrize("dst", list(Txn))
def test_the_transaction_moves_only_as_the_table_allows(src: Txn, dst: Txn) -> None:
    txn = TxnState()
    txn.state = src
    if (src, dst) in ALLOWED:
        assert txn.to(dst) is src
        assert txn.state is dst and txn.open == (dst in (Txn.OPEN, Txn.RETRYING))
    else:
        with pytest.raises(AssertionError, match=f"{src.value} -> {dst.value}"):
            txn.to(dst)
        assert txn.state is src
    assert {(s, d) for s, ds in MOVES.items() for d in ds} == ALLOWED
