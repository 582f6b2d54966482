"""Each sequence's state, for a stateful model (``[model.state.NAME]``).

The record key is the sequence: Kafka delivers a key's records in order to one
consumer, so the stage that holds a key's state sees its requests in order.
Before a request runs, its sequence's state is loaded into its row (the model's
initial state for a new sequence, or when the request says ``sequence_start``);
after it ran, the output that carries the next state is stored and left out of
the answer; ``sequence_end`` drops the state after the answer. Within a batch,
a key's requests run in successive engine runs (``waves``): one request per
sequence per run, in the order they were read.

Bounds: a sequence idle for ``model.state_ttl_s`` is dropped; at most
``model.max_sequences`` are kept, and a new sequence beyond that is answered
with the error ``too_many_sequences`` (a live sequence's state is never evicted
to make room). The states of a partition are dropped when it is revoked: its
next owner starts them afresh.

This version keeps states in memory only: a worker that stops or loses a
partition loses its sequences' states (docs/guides/stateful.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from worker.flow.codes import ErrorCode
from worker.flow.messages import Job, StateChange, TopicPartition
from worker.flow.values import ErrorInfo
from worker.model.inputs.state import BoundState
from worker.model.rows import Row


@dataclass
class _Sequence:
    values: dict[str, np.ndarray]
    tp: TopicPartition
    used: float


def waves(rows: Sequence[Row]) -> list[list[Row]]:
    """``rows`` as successive runs holding at most one row per key: run i holds
    each key's i-th row, so a key's rows run in the order they came."""
    out: list[list[Row]] = []
    seen: dict[bytes | None, int] = {}
    for row in rows:
        i = seen.get(row.job.key, 0)
        seen[row.job.key] = i + 1
        if i == len(out):
            out.append([])
        out[i].append(row)
    return out


class SequenceStates:
    def __init__(
        self,
        states: Sequence[BoundState],
        ttl_s: float,
        max_sequences: int,
        owns: Callable[[Job], bool] = lambda job: True,
    ) -> None:
        self._states = tuple(states)
        self._outputs = {s.output.name for s in self._states}
        self._ttl = ttl_s
        self._max = max_sequences
        self._live: dict[bytes, _Sequence] = {}
        # Whether a row's partition is still this worker's, as read (the app hands
        # in the offset tracker's answer): a row read before a revocation, still in
        # the pipeline when the partition came back, must not touch the states
        # restored since (its answer is dropped; its record is read again).
        self.owns = owns
        # Idle sequences are looked for at most this often (a scan of them all).
        self._expiry_interval = min(10.0, ttl_s / 4)
        self._expired_at = 0.0

    def __len__(self) -> int:
        return len(self._live)

    def load(self, row: Row, now: float) -> bool:
        """Put the row's sequence state into its values; False (and the row's
        error set) where it cannot run: no key, or no room for a new sequence."""
        key = row.job.key
        if not self.owns(row.job):
            row.error = ErrorInfo(ErrorCode.INTERNAL, "partition revoked: its new owner answers it")
            return False
        if key is None:
            row.error = ErrorInfo(
                ErrorCode.INVALID_REQUEST,
                "a stateful model needs a record key: the key names the sequence whose "
                "state this request continues",
            )
            return False
        seq = self._live.get(key)
        start = row.job.request is not None and row.job.request.sequence_start
        if seq is None or start:
            if seq is None and len(self._live) >= self._max:
                self.expire(now)
                if len(self._live) >= self._max:
                    row.error = ErrorInfo(
                        ErrorCode.TOO_MANY_SEQUENCES,
                        f"{self._max} sequences are live (model.max_sequences); end some with "
                        "sequence_end, or wait for idle ones to expire (model.state_ttl_s)",
                    )
                    return False
            seq = _Sequence({s.name: s.initial for s in self._states}, row.job.tp, now)
            self._live[key] = seq
        seq.used = now
        for state in self._states:
            row.values[state.name] = seq.values[state.name]
        return True

    def store(self, row: Row) -> None:
        """Keep the next state the row's run returned, and leave it out of the
        answer; drop the sequence after a ``sequence_end``."""
        key = row.job.key
        assert key is not None and row.outputs is not None
        seq = self._live.get(key)
        if seq is not None:
            for state in self._states:
                seq.values[state.name] = np.array(row.outputs[state.output.name])
            row.state = StateChange(dict(seq.values))
        row.outputs = {k: v for k, v in row.outputs.items() if k not in self._outputs}
        if row.job.request is not None and row.job.request.sequence_end:
            self._live.pop(key, None)
            row.state = StateChange(None)

    def restore(self, tp: TopicPartition, states: dict[bytes, dict[str, np.ndarray]],
                now: float) -> int:  # fmt: skip
        """Take over a newly assigned partition's sequences (read from the state
        changelog); a state whose shape no longer fits the model is skipped.
        Returns how many were restored."""
        restored = 0
        for key, values in states.items():
            fits = all(
                s.name in values and values[s.name].shape == s.initial.shape
                and values[s.name].dtype == s.initial.dtype
                for s in self._states
            )  # fmt: skip
            if fits:
                self._live[key] = _Sequence({s.name: values[s.name] for s in self._states}, tp, now)
                restored += 1
        return restored

    def expire_every(self, now: float) -> None:
        """``expire``, when the last scan is older than the expiry interval."""
        if now - self._expired_at >= self._expiry_interval:
            self._expired_at = now
            self.expire(now)

    def expire(self, now: float) -> int:
        """Drop sequences idle longer than the TTL; how many were dropped."""
        idle = [k for k, s in self._live.items() if now - s.used > self._ttl]
        for key in idle:
            del self._live[key]
        return len(idle)

    def forget(self, tps: Iterable[TopicPartition]) -> int:
        """Drop the sequences of revoked partitions (their next owner has them)."""
        gone = set(tps)
        dropped = [k for k, s in self._live.items() if s.tp in gone]
        for key in dropped:
            del self._live[key]
        return len(dropped)
