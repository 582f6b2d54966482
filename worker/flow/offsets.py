"""The per-partition contiguous watermark of acknowledged offsets: pure data, no I/O.

The consumer registers every offset it reads; the writer marks an
offset done once the broker acknowledged its result (or DLQ record). Batches
finish out of order, so the committable position of a partition is a contiguous
watermark: offset k+1 is committed only when every tracked offset <= k is done.
``worker.kafka.commit`` turns the watermarks into commits.

Callers, by method: ``redelivered`` and ``track`` (consume); ``owns`` and ``done`` (produce);
``committable``, ``mark_committed`` (commit); ``watermarks_with`` (the
exactly-once writer, ``worker.kafka.delivery.exactly_once``); ``forget`` and ``in_flight``
(the worker's revoke handling and backpressure).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog

from worker.flow.messages import TopicPartition

log = structlog.get_logger(__name__)


@dataclass
class _PartitionState:
    epoch: int  # changes whenever the partition is forgotten or reset
    pending: deque[int] = field(default_factory=deque)  # tracked, in read order
    sizes: dict[int, int] = field(default_factory=dict)  # bytes of offsets not yet done
    nbytes: int = 0  # the sum of sizes
    done: set[int] = field(default_factory=set)  # done but not yet below the watermark
    watermark: int | None = None  # next offset to commit (all below are done)
    committed: int | None = None  # last watermark handed to the broker


class OffsetTracker:
    """Per-partition contiguous watermark of done offsets, plus the record and byte
    counts that backpressure is decided on. No I/O.

    Every tracked offset belongs to an *epoch* of its partition. Revoking a
    partition (``forget``) or its offsets moving backwards (a reset, e.g. the
    broker lost its log) starts a new epoch, so results of older epochs are
    recognised as stale even when their offsets coincide with new ones.
    """

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionState] = {}
        self._epochs = 0
        self._bytes = 0
        self.resets = 0

    def _new_state(self) -> _PartitionState:
        self._epochs += 1
        return _PartitionState(epoch=self._epochs)

    def redelivered(self, tp: TopicPartition, offset: int, highwater: int | None) -> bool:
        """True when ``offset`` was already read in the partition's current epoch
        (this assignment) and the broker's log still reaches past what was read
        (``highwater``, the end offset the fetch that delivered it reported):
        a second delivery of a record already answered or in flight, which the
        consumer drops. Answering it again would be a duplicate, committed as
        such under exactly-once, and run a stateful model on a state that
        already includes it.

        False when the offset is new, and when the log ends below what was read
        (the broker lost its log: the embedded broker after a restart): that
        backwards offset is a reset, which ``track`` turns into a new epoch. An
        unknown ``highwater`` is taken as a reset (answered again, never lost).
        The order of deliveries alone cannot tell the two apart (issue 35)."""
        state = self._parts.get(tp)
        if state is None:
            return False
        read_to = state.pending[-1] + 1 if state.pending else state.watermark
        if read_to is None or offset >= read_to:
            return False
        return highwater is not None and highwater >= read_to

    def track(self, tp: TopicPartition, offset: int, nbytes: int = 0) -> int:
        """Register an offset as read; returns its epoch. Offsets of one partition
        arrive ascending; one that does not means the partition was reset (the
        consumer has dropped redeliveries first: see ``redelivered``)."""
        state = self._parts.get(tp)
        if state is None:
            state = self._parts[tp] = self._new_state()
        elif (state.pending and offset <= state.pending[-1]) or (
            state.watermark is not None and offset < state.watermark
        ):
            log.warning(
                "partition_reset",
                partition=f"{tp.topic}:{tp.partition}",
                offset=offset,
                previous=state.pending[-1] if state.pending else None,
            )
            self.resets += 1
            self._drop(tp)
            state = self._parts[tp] = self._new_state()
        state.pending.append(offset)
        state.sizes[offset] = nbytes
        state.nbytes += nbytes
        self._bytes += nbytes
        return state.epoch

    def owns(self, tp: TopicPartition, offset: int, epoch: int) -> bool:
        """True while ``offset`` of ``epoch`` is tracked and not done; False once
        its partition was revoked or reset, which makes its result stale."""
        state = self._parts.get(tp)
        return state is not None and state.epoch == epoch and offset in state.sizes

    def done(self, tp: TopicPartition, offset: int, epoch: int) -> None:
        """Mark an offset's result acknowledged (stale epochs are ignored)."""
        state = self._parts.get(tp)
        if state is None or state.epoch != epoch or offset not in state.sizes:
            return
        size = state.sizes.pop(offset)
        state.nbytes -= size
        self._bytes -= size
        state.done.add(offset)
        while state.pending and state.pending[0] in state.done:
            first = state.pending.popleft()
            state.done.discard(first)
            state.watermark = first + 1

    def in_flight(self, tp: TopicPartition | None = None) -> int:
        """Offsets read but not yet below the watermark."""
        if tp is not None:
            state = self._parts.get(tp)
            return 0 if state is None else len(state.pending)
        return sum(len(s.pending) for s in self._parts.values())

    @property
    def in_flight_bytes(self) -> int:
        """Bytes of records read whose results are not yet acknowledged."""
        return self._bytes

    def in_flight_by(
        self, group: Callable[[TopicPartition], int], groups: int
    ) -> list[tuple[int, int]]:
        """Records and bytes in flight per group of partitions (a model's topics)."""
        counts = [[0, 0] for _ in range(groups)]
        for tp, state in self._parts.items():
            c = counts[group(tp)]
            c[0] += len(state.pending)
            c[1] += state.nbytes
        return [(r, b) for r, b in counts]

    def committable(
        self, owned: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, int]:
        """Watermarks that moved since the last commit, restricted to ``owned``."""
        allowed = None if owned is None else set(owned)
        return {
            tp: s.watermark
            for tp, s in self._parts.items()
            if s.watermark is not None
            and s.watermark != s.committed
            and (allowed is None or tp in allowed)
        }

    def watermarks_with(
        self, answered: Iterable[tuple[TopicPartition, int, int]]
    ) -> tuple[dict[TopicPartition, int], bool]:
        """What the watermarks of the partitions in ``answered`` (partition,
        offset, epoch) would be were those offsets done too, and whether every
        one of them would then be below its partition's watermark. Changes
        nothing: the exactly-once writer commits these watermarks in the
        transaction that carries the answers, and marks them done only once the
        transaction committed. "False" means a gap: an earlier offset of a
        partition is still unanswered (batches can complete out of offset
        order), so committing now would leave answers above the committed
        offset, and a member that took over would answer them again."""
        extra: dict[TopicPartition, set[int]] = {}
        for tp, offset, epoch in answered:
            state = self._parts.get(tp)
            if state is not None and state.epoch == epoch and offset in state.sizes:
                extra.setdefault(tp, set()).add(offset)
        out: dict[TopicPartition, int] = {}
        complete = True
        for tp, offsets in extra.items():
            state = self._parts[tp]
            done = state.done | offsets
            watermark, below = state.watermark, 0
            for offset in state.pending:
                if offset not in done:
                    break
                watermark, below = offset + 1, below + 1
            complete = complete and below == len(done)
            if watermark is not None:
                out[tp] = watermark
        return out, complete

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, offset in offsets.items():
            state = self._parts.get(tp)
            if state is not None:
                state.committed = offset

    def committed(self, tp: TopicPartition) -> int | None:
        """The last offset committed for ``tp`` by this member, if any."""
        state = self._parts.get(tp)
        return None if state is None else state.committed

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop revoked partitions: results still arriving for them are stale."""
        for tp in tps:
            self._drop(tp)

    def _drop(self, tp: TopicPartition) -> None:
        state = self._parts.pop(tp, None)
        if state is not None:
            self._bytes -= state.nbytes

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)
