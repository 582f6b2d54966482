"""Comparing two deployments' answers: a candidate model beside production.

A shadow worker (``kafka.shadow = true``) reads the production input topic in a
group of its own and writes a result topic of its own. ``infer-worker compare``
reads both result topics from the beginning (no consumer group), joins the
results on their ``source`` (topic, partition, offset: the wire contract's
idempotency key; request ids are the clients' and need not be unique), and
reports per output how the candidate agrees with the baseline, where their
outcomes differ, each side's latency per stage and model version, and how much
of each side the join covered; thresholds make it a rollout gate.

* ``results``: what one result boils down to (``ResultRow``), and which
  outputs rank classes;
* ``stats``: the accumulators (agreement per output, outcomes, latency);
* ``join``: ``Comparison``, the join pair by pair as records are read;
* ``report``: the ``Report`` (JSON, text) and the ``Thresholds`` it is held to;
* ``read``: reading the topics; ``plot``: the PNG; ``cli``: the command line.
"""

from worker.ops.compare.cli import add_arguments, run
from worker.ops.compare.gates import Gate, Thresholds, failures, gates
from worker.ops.compare.join import Comparison
from worker.ops.compare.read import read_results
from worker.ops.compare.report import Accuracy, Coverage, Report
from worker.ops.compare.results import SIDES, Key, ResultRow, Side, class_of, ranking
from worker.ops.compare.stats import OutputAgreement, OutputSummary, StatusAgreement

__all__ = [
    "SIDES",
    "Accuracy",
    "Comparison",
    "Coverage",
    "Gate",
    "Key",
    "OutputAgreement",
    "OutputSummary",
    "Report",
    "ResultRow",
    "Side",
    "StatusAgreement",
    "Thresholds",
    "add_arguments",
    "class_of",
    "failures",
    "gates",
    "ranking",
    "read_results",
    "run",
]
