"""A budget on the monotonic clock.

Durations never use the wall clock (it jumps under NTP); only request deadlines,
which clients express as absolute epoch milliseconds, are converted from it once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass
class Deadline:
    """Expires ``seconds`` after creation on ``clock`` (monotonic by default)."""

    seconds: float
    clock: Clock = time.monotonic
    _start: float = field(init=False)

    def __post_init__(self) -> None:
        self._start = self.clock()

    @property
    def at(self) -> float:
        return self._start + self.seconds

    def remaining(self) -> float:
        return max(0.0, self.at - self.clock())

    def expired(self) -> bool:
        return self.clock() >= self.at


def epoch_ms_to_monotonic(deadline_ms: int, clock: Clock = time.monotonic) -> float:
    """Map a client's absolute epoch-ms deadline onto the monotonic clock, once,
    at decode time, so later comparisons are immune to wall-clock jumps."""
    return clock() + (deadline_ms / 1000.0 - time.time())
