"""Where the exactly-once writer's transaction stands, as one explicit state with
checked moves (as aiokafka checks its own ``TransactionState``): whether a
transaction is open, and whether the last one failed, which keeps delivery
not-ready until one commits again. Pure; ``exactly_once`` moves it."""

from __future__ import annotations

import enum


class Txn(enum.Enum):
    READY = "ready"  # none open; delivering
    OPEN = "open"  # one open: records sent in it, or a gap below them keeps it open
    FAILED = "failed"  # the last one aborted; its records wait to be sent again
    RETRYING = "retrying"  # one open again since a failure: not ready until it commits
    FENCED = "fenced"  # another process took the transactional id: this one stops


MOVES: dict[Txn, frozenset[Txn]] = {
    Txn.READY: frozenset({Txn.OPEN, Txn.FAILED, Txn.FENCED}),
    Txn.OPEN: frozenset({Txn.READY, Txn.FAILED, Txn.FENCED}),  # committed / revoked; failed
    Txn.FAILED: frozenset({Txn.RETRYING, Txn.FAILED, Txn.FENCED}),
    Txn.RETRYING: frozenset({Txn.READY, Txn.FAILED, Txn.FENCED}),  # committed; failed again
    Txn.FENCED: frozenset(),
}


class TxnState:
    def __init__(self) -> None:
        self.state = Txn.READY

    @property
    def open(self) -> bool:
        return self.state in (Txn.OPEN, Txn.RETRYING)

    def to(self, state: Txn) -> Txn:
        """Move to ``state`` and return the state it left; a move not in ``MOVES``
        is a bug in the writer, and raises."""
        if state not in MOVES[self.state]:
            raise AssertionError(f"transaction state {self.state.value} -> {state.value}")
        before, self.state = self.state, state
        return before
