"""Priority lanes: which requests a batch takes first, and whose partitions pause
first under backpressure. Pure decisions, no I/O (the flush rules are
``worker.flow.batching``'s, per lane).

A lane is a set of input topics with a rank (0 = served first). ``LanePolicy``
keeps one FIFO per lane and cuts a batch from them: first each lane's
``min_share`` of the rows (while it has requests waiting), then the rest by
rank. A batch is due when it is full, when some lane's oldest request has
waited that lane's delay, or when a request's deadline (less the expected
service time) comes. A lane with a rate cap (``max_rate``,
``worker.flow.throttle``) gives a batch only the rows its cap allows, and is
due only once its cap allows the rows it holds. A partition's records are in
one lane and leave it in order, so order per partition holds.

``LaneBackpressure`` gives each lane its own pause bound: the lowest lane pauses
at the in-flight bound and resumes last; each lane above may read further
(up to ``headroom`` past the bound for the most urgent one) and resumes
earlier, so the fetch and in-flight budgets go to the urgent lanes first.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from worker.flow.backpressure import Action, Backpressure
from worker.flow.batching import ewma
from worker.flow.messages import Batch, FlushReason, T
from worker.flow.throttle import Throttle, lane_throttle


@dataclass(frozen=True)
class Lane:
    rank: int  # 0 = served first
    name: str
    delay: float  # seconds a request may wait for its batch to fill
    min_share: float = 0.0  # of every batch's rows, while it has requests waiting
    max_rate: float = 0.0  # rows a second into batches, at most (0: no cap)


def reserved_rows(min_share: float, rows: int) -> int:
    """A lane's guaranteed rows of a batch of ``rows``: its share, rounded up."""
    return math.ceil(min_share * rows - 1e-9) if min_share > 0 else 0


@dataclass
class LanePolicy(Generic[T]):
    """``BatchPolicy``'s interface over several lanes; ``lane_of`` maps an item to
    its lane's rank. ``observe`` is called with each batch cut (metrics)."""

    lanes: Sequence[Lane]
    lane_of: Callable[[T], int]
    max_batch_size: int
    capacity: int  # items held across lanes before the batcher stops reading
    service_time: float = 0.0
    observe: Callable[[Batch[T]], None] | None = None
    _queues: list[deque[T]] = field(default_factory=list)
    # A capped lane's throttle, by rank (None: no cap).
    _throttles: list[Throttle | None] = field(default_factory=list)
    _held: int = 0
    _min_deadline: float | None = None
    _deadlines_dirty: bool = False
    _seq: int = 0

    def __post_init__(self) -> None:
        self.lanes = sorted(self.lanes, key=lambda lane: lane.rank)
        assert [lane.rank for lane in self.lanes] == list(range(len(self.lanes)))
        self._queues = [deque() for _ in self.lanes]
        self._throttles = [lane_throttle(lane.max_rate, self.max_batch_size) for lane in self.lanes]

    def __len__(self) -> int:
        return self._held

    @property
    def has_room(self) -> bool:
        # Read past one batch, unlike BatchPolicy: an urgent request must not wait
        # in the input queue behind the lower lanes' backlog.
        return self._held < self.capacity

    def add(self, item: T) -> None:
        rank = self.lane_of(item)
        self._queues[rank].append(item)
        self._held += 1
        d = item.deadline
        # A capped lane's deadlines do not make a batch due: its requests wait
        # for the cap whatever their deadlines (and are answered late if so).
        if d is not None and not self._deadlines_dirty and self._throttles[rank] is None:
            self._min_deadline = d if self._min_deadline is None else min(self._min_deadline, d)

    def observe_service_time(self, seconds: float, alpha: float = 0.2) -> None:
        self.service_time = ewma(self.service_time, seconds, alpha)

    def next_flush_at(self) -> float | None:
        """When some lane's delay or some request's deadline fires; None when empty."""
        if not self._held:
            return None
        at = min(self._due())
        deadline = self._earliest_deadline()
        if deadline is not None:
            at = min(at, deadline - self.service_time)
        return at

    def take(self, now: float, *, queue_drained: bool) -> Batch[T] | None:
        """A batch when a flush rule fires at ``now`` (full, a lane's delay, a
        deadline), else None. Preferred sizes are not used with lanes: a batch is
        formed by rank, not by how many arrived."""
        if not self._held:
            return None
        takeable = self._takeable(now)
        if sum(takeable) >= self.max_batch_size:
            return self._cut(now, "full", takeable)
        flush_at = self.next_flush_at()
        assert flush_at is not None
        if now < flush_at or not any(takeable):
            return None
        delay_due = any(now >= due for due in self._due())
        return self._cut(now, "delay" if delay_due else "deadline", takeable)

    def _takeable(self, now: float) -> list[int]:
        """Rows each lane may give a batch at ``now``: what it holds, less what
        its cap does not allow yet."""
        return [
            len(q) if t is None else min(len(q), t.available(now))
            for q, t in zip(self._queues, self._throttles, strict=True)
        ]

    def _due(self) -> list[float]:
        """When each lane holding requests is due: its oldest has waited its
        delay, and for a capped lane, its cap allows the rows it holds (a batch's
        worth at most)."""
        due = []
        for q, lane, throttle in zip(self._queues, self.lanes, self._throttles, strict=True):
            if q:
                at = q[0].arrived + lane.delay
                if throttle is not None:
                    at = max(at, throttle.ready_at(min(len(q), self.max_batch_size)))
                due.append(at)
        return due

    def drain(self, now: float) -> Batch[T] | None:
        """Everything held as one last batch (shutdown), in rank order."""
        if not self._held:
            return None
        items = [item for q in self._queues for item in q]
        for q in self._queues:
            q.clear()
        self._held = 0
        self._min_deadline, self._deadlines_dirty = None, False
        return self._batch(items, now, "drain")

    def _cut(self, now: float, reason: FlushReason, takeable: list[int]) -> Batch[T]:
        rows = min(self.max_batch_size, sum(takeable))
        counts = [0] * len(self._queues)
        left = rows
        for i, (n, lane) in enumerate(zip(takeable, self.lanes, strict=True)):
            if lane.min_share and n:
                counts[i] = min(n, reserved_rows(lane.min_share, rows), left)
                left -= counts[i]
        for i, n in enumerate(takeable):
            extra = min(n - counts[i], left)
            counts[i] += extra
            left -= extra
        items: list[T] = []
        for q, n, throttle in zip(self._queues, counts, self._throttles, strict=True):
            items.extend(q.popleft() for _ in range(n))
            if throttle is not None and n:
                throttle.take(n, now)
        self._held -= rows
        self._deadlines_dirty = True
        return self._batch(items, now, reason)

    def _batch(self, items: list[T], now: float, reason: FlushReason) -> Batch[T]:
        self._seq += 1
        batch = Batch(items=items, formed_at=now, reason=reason, seq=self._seq)
        if self.observe is not None:
            self.observe(batch)
        return batch

    def _earliest_deadline(self) -> float | None:
        if self._deadlines_dirty:  # once per cut, not per loop turn
            found = [
                i.deadline
                for q, throttle in zip(self._queues, self._throttles, strict=True)
                if throttle is None
                for i in q
                if i.deadline is not None
            ]
            self._min_deadline = min(found) if found else None
            self._deadlines_dirty = False
        return self._min_deadline


class LaneBackpressure:
    """One pause decision per lane over the same in-flight counts: lane ``r`` of
    ``n`` pauses at ``bound * (1 + headroom * (n - 1 - r) / (n - 1))`` and resumes
    at ``resume_ratio`` of that. One lane: exactly ``Backpressure``."""

    def __init__(
        self,
        max_records: int,
        max_bytes: int,
        lanes: int = 1,
        headroom: float = 0.5,
        resume_ratio: float = 0.5,
    ) -> None:
        def scale(rank: int) -> float:
            return LaneBackpressure.scale(rank, lanes, headroom)

        self.lanes = [
            Backpressure(int(max_records * scale(r)), int(max_bytes * scale(r)), resume_ratio)
            for r in range(lanes)
        ]
        # Several models in one worker: one decision per model over that model's own
        # in-flight counts (``apart``), so one model's backlog pauses only its topics.
        self.apart = False
        self.labels: list[str] = []
        self.groups: list[int] | None = None  # each rank's model, with lanes and models

    @classmethod
    def per_model(
        cls,
        bounds: Sequence[tuple[int, int]],
        labels: Sequence[str],
        resume_ratio: float = 0.5,
        groups: Sequence[int] | None = None,
    ) -> LaneBackpressure:
        """One ``Backpressure`` per model, each at its own bounds (records, bytes),
        decided on its own counts (``update_each``). ``groups``: several models
        with priority lanes, one decision per (model, lane), each rank's group
        its model: a rank decides on its whole model's counts (its lanes share
        the model's in-flight work), at its own bounds (an urgent lane's higher)."""
        bp = cls(1, 1)
        bp.lanes = [Backpressure(r, b, resume_ratio) for r, b in bounds]
        bp.apart, bp.labels = True, list(labels)
        bp.groups = list(groups) if groups is not None else None
        return bp

    def admit(self, bounds: tuple[int, int], label: str, resume_ratio: float = 0.5) -> int:
        """One more model paused on its own counts (``apart``, without lanes): a
        model the control topic brought; its rank."""
        assert self.apart and self.groups is None, "models paused apart, without lanes"
        self.lanes.append(Backpressure(*bounds, resume_ratio))
        self.labels.append(label)
        return len(self.lanes) - 1

    @staticmethod
    def scale(rank: int, lanes: int, headroom: float = 0.5) -> float:
        """Lane ``rank`` of ``lanes``: its bounds' factor (the most urgent, the
        largest: it pauses last)."""
        return 1.0 + (headroom * (lanes - 1 - rank) / (lanes - 1) if lanes > 1 else 0.0)

    @property
    def paused(self) -> bool:
        """Whether any lane is paused (the consumer then polls often)."""
        return any(b.paused for b in self.lanes)

    @property
    def all_paused(self) -> bool:
        """Whether every lane is paused (nothing to fetch)."""
        return all(b.paused for b in self.lanes)

    def is_paused(self, rank: int) -> bool:
        return self.lanes[rank].paused

    def update(self, records: int, nbytes: int) -> list[tuple[int, Action]]:
        """Each lane whose state changes now, lowest lane first (paused first,
        resumed last)."""
        return self.update_each([(records, nbytes)] * len(self.lanes))

    def update_each(self, counts: Sequence[tuple[int, int]]) -> list[tuple[int, Action]]:
        """``update`` with each lane's (or model's) own in-flight records and bytes;
        with ``groups``, each rank's model's (its ranks' counts summed)."""
        if self.groups is not None:
            total: dict[int, tuple[int, int]] = {}
            for g, (records, nbytes) in zip(self.groups, counts, strict=True):
                seen = total.get(g, (0, 0))
                total[g] = (seen[0] + records, seen[1] + nbytes)
            counts = [total[g] for g in self.groups]
        pairs = zip(self.lanes, counts, strict=True)
        changes = [(r, b.update(*c)) for r, (b, c) in enumerate(pairs)]
        return [(r, a) for r, a in reversed(changes) if a is not None]
