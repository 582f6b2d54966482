"""The project's error hierarchy.

Third-party exceptions (aiokafka, msgpack, onnxruntime, CUDA) are translated into
these once, at the boundary where they are raised, so the pipeline reasons about
one vocabulary. ``code`` is the wire-level error code (see schemas/README.md);
``retriable`` says whether trying the same work again can succeed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.flow.codes import ErrorCode


class WorkerError(Exception):
    """Root of every error the worker raises on purpose."""

    # A contract code (``ErrorCode``) for errors a request is answered with; the
    # process-level ones below (a configuration, a dead engine) name why it stops.
    code: str = ErrorCode.INTERNAL
    retriable: bool = False


class ConfigError(WorkerError):
    """The configuration is invalid; the message names the offending field."""

    code = "config_error"


class RecordError(WorkerError):
    """Something is wrong with one input record; retrying it cannot help."""


class UndecodableRecord(RecordError):
    """The record is not a msgpack map we can read at all: it goes to the DLQ
    with its original bytes, because there is no request id to answer to."""

    code = ErrorCode.UNDECODABLE


class RecordTooLarge(UndecodableRecord):
    """The record's bytes exceed the configured limit; rejected before decoding."""

    code = ErrorCode.TOO_LARGE


class CrashLoop(UndecodableRecord):
    """Whole worker processes died, again and again, with this record at the head
    of its partition: it is sent to the DLQ unrun (see pipeline/crashguard.py)."""

    code = ErrorCode.CRASH_LOOP


class InvalidRequest(RecordError):
    """The record decoded but breaks the contract. The client gets an error
    result, echoing whatever id/meta could be recovered."""

    code = ErrorCode.INVALID_REQUEST

    def __init__(
        self,
        message: str,
        *,
        request_id: str = "",
        meta: Mapping[str, Any] | None = None,
        key: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.meta = meta
        self.key = key


class UnknownModel(InvalidRequest):
    """The request names a model, or a version of one, the worker does not serve;
    the message names what it does serve."""

    code = ErrorCode.UNKNOWN_MODEL


class TensorTooLarge(InvalidRequest):
    """A tensor is larger than the configured limit (e.g. image pixels)."""

    code = ErrorCode.TOO_LARGE


class InferenceFailed(WorkerError):
    """The engine failed on one batch. The batch is answered with errors (or,
    from the reliability work on, split to isolate the poison request); the
    engine itself stays usable."""

    code = ErrorCode.INFERENCE_FAILED


class EngineDead(WorkerError):
    """The engine can no longer run anything (device lost, session closed).
    The worker must stop without committing unfinished work."""

    code = "engine_dead"


class DeliveryFailed(WorkerError):
    """Results could not be acknowledged by the broker in time."""

    code = "delivery_failed"
    retriable = True


class TransactionFenced(WorkerError):
    """Exactly-once: another process took this member's transactional id (a
    restarted instance of it), so this one is a zombie and must stop."""

    code = "transaction_fenced"


class BrokerUnavailable(WorkerError):
    """The Kafka cluster cannot be reached (at start-up)."""

    code = "broker_unavailable"
    retriable = True


class FailureBudgetExceeded(WorkerError):
    """Too many records are failing: the worker halts rather than drain the
    input into the DLQ (see ``[dlq]`` in the configuration)."""

    code = "failure_budget_exceeded"
