"""Delivery verification: did every request get exactly one answer, in order?

The worker promises at-least-once delivery: every record on an input topic gets
a result on the output topic or, when it cannot be answered at all, a record on
the DLQ, and the results of one input partition appear in request order. This
module checks that promise from the outside, from nothing but the topics
themselves, so it can judge any worker build (or a fault-injection run) without
trusting the worker's own metrics or committed offsets.

It has two halves:

* a pure core, ``verify`` / ``check``, that compares the offsets requested with
  the sources the answers name and builds a ``Report``; no I/O, so every rule is
  unit-tested on plain tuples;
* ``read_topics``, which reads the three topic sets from the beginning without a
  consumer group (a verifier must not move anybody's committed offsets) and
  turns records into the core's inputs.

``add_arguments`` / ``run`` (``cli``) are the ``infer-worker verify`` command line;
the types and the ``Report`` live in ``report``, the core in ``check``, the
reading in ``read``.

The join key is the ``source`` {topic, partition, offset} that every result
carries and the ``source.*`` headers of every DLQ record: the wire contract's
idempotency key. Request ids are client-chosen and need not be unique, so they
are never used to match.
"""

from worker.ops.verify.check import check, verify
from worker.ops.verify.cli import add_arguments, run
from worker.ops.verify.read import Observed, read_topics
from worker.ops.verify.report import (
    DlqRow,
    Duplicate,
    InputRecord,
    Inputs,
    Kind,
    OrderingViolation,
    OutputRow,
    PartitionReport,
    Reply,
    Report,
    Totals,
    Unparseable,
)

__all__ = [
    "DlqRow",
    "Duplicate",
    "InputRecord",
    "Inputs",
    "Kind",
    "Observed",
    "OrderingViolation",
    "OutputRow",
    "PartitionReport",
    "Reply",
    "Report",
    "Totals",
    "Unparseable",
    "add_arguments",
    "check",
    "read_topics",
    "run",
    "verify",
]
