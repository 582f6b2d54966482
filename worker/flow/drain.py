"""How much work waits for each model, and how long it takes to answer: the
signals an autoscaler reads (``infer_backlog_records``,
``infer_seconds_to_drain``). Pure: the lag monitor feeds it the partitions'
lag, the inference stages feed it their batches' times; no clocks are read here.

Per model (or pipeline: it answers like one), on one member:

* the backlog is the lag (high watermark minus committed offset) of the
  partitions this member owns of the topics routed to it. A shared topic (whose
  requests name their model, ``worker.config.models.Routing.shared``) is split
  by the shares of the records the intake routed from it lately (``Shares``);
  before any was read, all of it is its owner's, the model answering requests
  naming none;
* the seconds to drain are that backlog over the rate the model answers at
  while it is busy (``BusyRate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Weight of the newest window in the rate's moving average: a window is one lag
# poll (seconds of batches), already an average, so a backlog's onset is
# followed within a poll or two.
RATE_ALPHA = 0.5
# Busy time below this in a window is too little to time a rate on (a single
# tiny batch's timer noise: a batch handed to a thread takes longer): the window
# is carried into the next one.
MIN_BUSY_S = 0.0001
# How much of the shares' counts a poll keeps: "lately" is the last few polls.
SHARES_KEPT = 0.5


@dataclass
class BusyRate:
    """Answers per second a model gives while at least one of its batches is in
    flight, as a moving average over windows (one per lag poll).

    Why this is the rate a backlog drains at: while a model has a backlog, its
    batcher always has a batch ready, so some batch is always in flight and the
    busy time is the wall time; answers over busy time is then the throughput
    actually reached, with however many batches it runs at once (threads,
    slots) and whatever they cost each other (shared cores, a GPU's copies
    beside its kernels), without assuming a batch's service time divides by
    the number running. Idle gaps (no request waiting) are left out, so a model
    that is lightly used is not timed as slow; it is timed at the small batches
    light traffic makes, below what full batches reach, so the seconds to drain
    at a backlog's onset err long (towards scaling out) for a poll or two.

    What it does not see: a slower consume or produce path (the broker, the
    writer) starves or holds the stage between batches, and those gaps are not
    busy time: the seconds to drain are then a lower bound."""

    rate: float | None = None  # answers/s; None until a window had enough busy time
    _in_flight: int = 0
    _busy_since: float = 0.0
    _busy_s: float = 0.0  # this window's busy time, batches still in flight excluded
    _answers: int = 0  # answers given in this window

    def began(self, now: float) -> None:
        """A batch was dispatched at ``now`` (monotonic seconds)."""
        if self._in_flight == 0:
            self._busy_since = now
        self._in_flight += 1

    def ended(self, now: float, answers: int) -> None:
        """A batch finished at ``now`` with ``answers`` answers (0: it failed)."""
        self._in_flight -= 1
        self._answers += answers
        if self._in_flight == 0:
            self._busy_s += now - self._busy_since

    def sample(self, now: float) -> float | None:
        """Close the window at ``now`` (a lag poll), fold it into the average and
        return the rate. A window with no answers or too little busy time
        leaves the rate as it was (an idle model keeps its last measured rate:
        its backlog, if one comes, drains at it)."""
        busy = self._busy_s
        if self._in_flight:
            busy += now - self._busy_since
        if self._answers == 0 or busy < MIN_BUSY_S:
            return self.rate
        window = self._answers / busy
        self.rate = window if self.rate is None else ewma(self.rate, window)
        self._answers, self._busy_s = 0, 0.0
        if self._in_flight:
            self._busy_since = now
        return self.rate


def ewma(current: float, sample: float, alpha: float = RATE_ALPHA) -> float:
    return (1 - alpha) * current + alpha * sample


@dataclass
class Shares:
    """Per shared topic, how many of the records the intake read from it lately
    went to each model: the split of that topic's backlog. The records behind
    the read position are not read yet, so their models are not known; what was
    read last is the best estimate of what follows, and an operator can act on
    it (each model's seconds to drain count their share). Decayed each poll
    (``SHARES_KEPT``) so a change in the mix shows within a few polls."""

    _counts: dict[str, dict[str, float]] = field(default_factory=dict)

    def count(self, topic: str, model: str) -> None:
        """One record of ``topic`` routed to ``model`` (the intake, per record)."""
        counts = self._counts.setdefault(topic, {})
        counts[model] = counts.get(model, 0.0) + 1.0

    def split(self, topic: str, backlog: int, owner: str) -> dict[str, int]:
        """``backlog`` records of ``topic`` by model, in whole records that add up
        to it (largest remainders); all ``owner``'s where nothing was read yet."""
        counts = self._counts.get(topic)
        total = sum(counts.values()) if counts else 0.0
        if not counts or total <= 0.0:
            return {owner: backlog}
        exact = {model: backlog * n / total for model, n in counts.items()}
        whole = {model: math.floor(x) for model, x in exact.items()}
        left = backlog - sum(whole.values())
        for model in sorted(exact, key=lambda m: whole[m] - exact[m])[:left]:
            whole[model] += 1
        return whole

    def decay(self) -> None:
        """Age the counts (once per lag poll); a model not read from in a while
        drops out of the split."""
        for counts in self._counts.values():
            for model in list(counts):
                counts[model] *= SHARES_KEPT
                if counts[model] < 0.5:
                    del counts[model]


def backlog_by_model(
    lags: Iterable[tuple[str, int]],
    owner: Callable[[str], str],
    shared: frozenset[str],
    shares: Shares,
) -> dict[str, int]:
    """Each model's backlog from ``lags`` (topic, records) of the partitions a
    member owns: a topic's lag is its owner's (``owner``), a shared topic's is
    split by ``shares``. Every owner of a partition appears, at 0 where it has
    no backlog, so its series says 0 rather than vanishing."""
    by_topic: dict[str, int] = {}
    for topic, lag in lags:
        by_topic[topic] = by_topic.get(topic, 0) + lag
    out: dict[str, int] = {}
    for topic, lag in by_topic.items():
        first = owner(topic)
        out.setdefault(first, 0)
        parts = shares.split(topic, lag, first) if topic in shared else {first: lag}
        for model, n in parts.items():
            out[model] = out.get(model, 0) + n
    return out


def seconds_to_drain(backlog: int, rate: float | None) -> float | None:
    """``backlog`` records at ``rate`` answers/s: 0 without a backlog (whatever
    the rate), None where a backlog waits and no rate was measured yet (the
    model has not answered since it started: no honest number exists)."""
    if backlog <= 0:
        return 0.0
    if rate is None or rate <= 0.0:
        return None
    return backlog / rate

