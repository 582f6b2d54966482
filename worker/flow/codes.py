"""The contract's error codes: one enum, the only place they are spelled.

A result's ``error.code`` and a DLQ record's ``error.code`` header carry one of
these (schemas/README.md); the exceptions that stand for them carry them as
their ``code`` (``worker.flow.errors``), and ``ErrorInfo`` accepts nothing
else. A ``StrEnum``: each member is its wire string, so it is written, compared
and used as a metric label as the string it always was.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INFERENCE_FAILED = "inference_failed"
    TOO_LARGE = "too_large"
    UNDECODABLE = "undecodable"
    CRASH_LOOP = "crash_loop"
    INTERNAL = "internal"
    # A stateful model holds model.max_sequences sequences: a new one waits.
    TOO_MANY_SEQUENCES = "too_many_sequences"
    # A request names a model (or a model's version) the worker does not serve.
    UNKNOWN_MODEL = "unknown_model"


# Error messages end up in results and Kafka headers; a client-chosen name or
# an exception's text must not make them unbounded. ``ErrorInfo`` caps them.
MAX_ERROR_MESSAGE_CHARS = 1024
