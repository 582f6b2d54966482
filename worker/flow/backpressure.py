"""When to pause and resume fetching: a pure decision with hysteresis, no I/O.

The worker pauses its partitions (and keeps polling, so it stays in the group)
when the records or bytes it has read but not yet answered reach a bound, and
resumes once they fall to ``resume_ratio`` of it. The gap keeps it from
flapping on every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Action = Literal["pause", "resume"]


@dataclass
class Backpressure:
    max_records: int
    max_bytes: int
    resume_ratio: float = 0.5
    paused: bool = False

    def update(self, records: int, nbytes: int) -> Action | None:
        """The action to take now, given what is in flight (None: keep as is)."""
        if not self.paused and (records >= self.max_records or nbytes >= self.max_bytes):
            self.paused = True
            return "pause"
        if (
            self.paused
            and records <= self.max_records * self.resume_ratio
            and nbytes <= self.max_bytes * self.resume_ratio
        ):
            self.paused = False
            return "resume"
        return None
