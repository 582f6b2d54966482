"""The one decision of what to send after a failed send, for both writers:
the same bytes again, again in a record batch of its own, the record's small
error answer instead, or give up; and whether the producer must be replaced
first. Pure: a table tests/unit/kafka/test_delivery_decisions.py checks."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    RecordListTooLargeError,
    RecordTooLargeError,
    UnknownProducerId,
)

from worker.flow.codes import ErrorCode
from worker.kafka.delivery.outgoing import FallbackCode, OutRecord
from worker.kafka.permissions import NOT_AUTHORISED

# Broker and client refusals that mean "this record is too large": the fallback
# is then a ``too_large`` answer; any other permanent refusal is ``internal``.
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError)
# What an idempotent producer's broken sequence looks like. aiokafka numbers a
# partition's record batches as it sends them and never renumbers: once the
# broker refuses one for good (too large, say), it refuses every later batch of
# that partition as out of order. Those records were never written; they are
# re-sent through a new producer (new producer id, sequences from 0).
SEQUENCE_BROKEN = (OutOfOrderSequenceNumber, UnknownProducerId)


def retriable(exc: BaseException) -> bool:
    """Whether sending the same record again can succeed. aiokafka raises
    ``KafkaTimeoutError`` (which does not call itself retriable) when a record
    could not even be queued within ``request_timeout_ms``, because its
    partition's pending batch was not drained: the partition's leader is gone
    (measured: SIGKILL of a partition leader of a three-broker cluster). The
    record was never written and took no sequence number: it is re-sent as it
    is, not replaced by a fallback as a refusal for good would be. A missing
    permission is waited out the same way (``NOT_AUTHORISED``)."""
    if isinstance(exc, NOT_AUTHORISED):
        # Not for good: the ACL can come back, and a fallback answer would be
        # refused by the same missing permission (or, on the DLQ, divert every
        # answer). Sent again with backoff, delivery not-ready, offsets held.
        return True
    return isinstance(exc, KafkaTimeoutError) or bool(getattr(exc, "retriable", True))


def refusal_code(exc: BaseException) -> FallbackCode:
    """Translate a permanent delivery failure into the fallback's error code."""
    return ErrorCode.TOO_LARGE if isinstance(exc, _TOO_LARGE) else ErrorCode.INTERNAL


class Action(enum.Enum):
    RESEND = "resend"  # the same bytes again
    RESEND_ALONE = "resend alone"  # again, in a record batch of its own
    FALL_BACK = "fall back"  # its small error answer instead
    GIVE_UP = "give up"  # even its fallback was refused: the worker stops


@dataclass(frozen=True)
class Verdict:
    action: Action
    renew: bool  # replace the producer before anything is sent again


def decide(
    record: OutRecord,
    failure: BaseException | None,
    *,
    idempotent: bool,
    shared: bool,
    alone: bool,
) -> Verdict:
    """What to send next for a record whose send failed, or whose transaction was
    aborted: the one place both writers decide it.

    ``failure``: why the record was not acknowledged (None: it was, but its
    transaction failed for another reason); ``shared``: the same failure struck
    other records too (the broker refuses a record batch as a whole, so one
    record too large for the topic has every record batched with it refused);
    ``alone``: the record was already sent in a record batch of its own.

    - never written (a broken idempotent sequence, a timeout before it was even
      queued, any retriable error): the same bytes again;
    - refused for good with its neighbours: each alone first, so only the one
      that is too large gets a fallback;
    - refused for good alone: its small fallback (a ``too_large`` or
      ``internal`` answer), once; a refused fallback is fatal.

    A refusal for good leaves a gap in an idempotent producer's sequence: the
    records after it then fail as out of order, so the producer is replaced
    (a new producer id, sequences from 0) before the next send."""
    if failure is None:
        return Verdict(Action.RESEND, renew=False)
    if isinstance(failure, SEQUENCE_BROKEN):
        return Verdict(Action.RESEND, renew=idempotent)
    if retriable(failure):
        return Verdict(Action.RESEND, renew=False)
    if shared and not alone:
        return Verdict(Action.RESEND_ALONE, renew=idempotent)
    if record.fallback:
        return Verdict(Action.GIVE_UP, renew=idempotent)
    return Verdict(Action.FALL_BACK, renew=idempotent)
