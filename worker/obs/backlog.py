"""The autoscaling signals per model: its backlog in records and the seconds it
takes to drain (``worker.flow.drain`` computes them; the lag monitor,
``worker.kafka.monitors``, publishes them each poll). The gauges are named in
``worker.obs.metrics`` too, where the metrics reference reads every metric.

Each model's (and pipeline's) ``BusyRate`` lives here, by name, so the
inference stage that times its batches and the monitor that reads the rate
share one without either importing the other (compute and kafka never do)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from prometheus_client import Gauge

from worker.flow.drain import BusyRate, seconds_to_drain

BACKLOG_RECORDS = Gauge(
    "infer_backlog_records",
    "Per model or pipeline: the lag (high watermark minus committed offset) of the input "
    "partitions this member owns of the topics routed to it; a shared topic's (requests "
    "naming their model) split by the shares of its records read lately, all its owner's "
    "before any was read",
    ["model"],
)
SECONDS_TO_DRAIN = Gauge(
    "infer_seconds_to_drain",
    "Per model or pipeline: infer_backlog_records over the answers per second it gives "
    "while busy (measured, averaged over lag polls); 0 without a backlog, absent while a "
    "backlog waits and the model has not answered yet since start (no rate measured)",
    ["model"],
)

# Per model or pipeline name: the rate its stage times (``rate_of``).
_RATES: dict[str, BusyRate] = {}
_published: set[str] = set()


def rate_of(model: str) -> BusyRate:
    """The busy rate of ``model`` (or pipeline): its stage reports each batch's
    start and end to it, the lag monitor samples it."""
    if (found := _RATES.get(model)) is None:
        found = _RATES[model] = BusyRate()
    return found


def publish(backlogs: Mapping[str, int], now: float) -> dict[str, float | None]:
    """Set both gauges for every model in ``backlogs`` (a lag poll's, at monotonic
    ``now``), and drop the series of models no longer in it (their partitions
    moved to another member: a stale backlog would scale the group for ever).
    Returns each model's seconds to drain (None: no rate yet)."""
    out: dict[str, float | None] = {}
    for model, records in backlogs.items():
        seconds = seconds_to_drain(records, rate_of(model).sample(now))
        BACKLOG_RECORDS.labels(model).set(records)
        if seconds is None:
            # Absent, not NaN or +Inf: a query over it (sum, max) then reads the
            # other members' series, where NaN would poison the sum and +Inf
            # would scale to the maximum on a model that simply has not started.
            _remove(SECONDS_TO_DRAIN, model)
        else:
            SECONDS_TO_DRAIN.labels(model).set(seconds)
        out[model] = seconds
    for model in _published - backlogs.keys():
        _remove(BACKLOG_RECORDS, model)
        _remove(SECONDS_TO_DRAIN, model)
    _published.clear()
    _published.update(backlogs)
    return out


def withdraw_all() -> None:
    """Drop every series and rate (the worker stopped: a later worker in the same
    process starts measuring afresh)."""
    publish({}, 0.0)
    _RATES.clear()


def _remove(gauge: Gauge, model: str) -> None:
    with contextlib.suppress(KeyError):  # never set for this model
        gauge.remove(model)
