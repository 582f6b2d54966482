"""Time budgets: the one place a deadline is computed from "now plus so long".

Every bounded wait (a revocation's settling, the crash guard's read, the group
lease, the changelog restore, a GPU batch's completion, the tools' reads and
polls, shutdown's drain) takes a ``Deadline`` and asks it what is left, so a
budget is decided once, on one clock (monotonic), and a step that must still be
tried however late says so (``left(floor)``). A request's own deadline is an
instant on the same clock (``Job.deadline``, from its ``deadline_ms``), set once
at intake and read by the batcher and the inference stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    """A time budget: what is left of ``seconds`` from now."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self._end = self.started + seconds

    def left(self, floor: float = 0.0) -> float:
        """Seconds left, but at least ``floor`` (for a step that must still be
        tried, a commit or closing a socket, however late)."""
        return max(floor, self._end - self._clock())

    @property
    def expired(self) -> bool:
        return self._clock() >= self._end

    def elapsed(self) -> float:
        return self._clock() - self.started
