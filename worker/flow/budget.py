"""The failure budget: a pure counter deciding when failures look systematic.

One bad record is the client's problem; a thousand in a row, or half of the
stream, means something upstream or in the model is broken, and answering each
with a DLQ record would only drain the topic. The worker then halts instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice


@dataclass
class FailureBudget:
    max_consecutive: int  # 0 disables
    max_ratio: float  # over the last `window` records, checked once the window is full
    window: int
    _recent: deque[bool] = field(init=False)
    _failures: int = 0
    consecutive: int = 0

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.window)

    def record(self, failed: bool) -> str | None:
        """Count one answered record; returns why the budget is exceeded, or None."""
        if len(self._recent) == self.window:
            self._failures -= self._recent[0]  # about to fall out of the window
        self._recent.append(failed)
        self._failures += failed
        self.consecutive = self.consecutive + 1 if failed else 0
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            return f"{self.consecutive} consecutive failed records (dlq.max_consecutive)"
        if len(self._recent) >= self.window and self._failures / self.window > self.max_ratio:
            return (
                f"{self._failures} of the last {self.window} records failed "
                f"(dlq.max_ratio {self.max_ratio})"
            )
        return None

    def record_all(self, failed: Sequence[bool]) -> tuple[int, str] | None:
        """Count a batch's answered records in order: the index of the first at
        which the budget is exceeded and why, or None. A batch without failures
        (the common case) is counted at once where it can only lower the counts:
        no failure in the window, or a window already full (one that fills up
        now may hold failures enough to exceed ``max_ratio``)."""
        if True in failed or (self._failures and len(self._recent) < self.window):
            for i, one in enumerate(failed):
                reason = self.record(one)
                if reason is not None:
                    return i, reason
            return None
        if not failed:
            return None
        falling_out = len(self._recent) + len(failed) - self.window
        if self._failures and falling_out > 0:
            self._failures -= sum(islice(self._recent, falling_out))
        self._recent.extend(failed)
        self.consecutive = 0
        return None
