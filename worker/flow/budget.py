"""The failure budget: a pure counter deciding when failures look systematic.

One bad record is the client's problem; a thousand in a row, or half of the
stream, means something upstream or in the model is broken, and answering each
with a DLQ record would only drain the topic. The worker then halts instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class FailureBudget:
    max_consecutive: int  # 0 disables
    max_ratio: float  # over the last `window` records, checked once the window is full
    window: int
    _recent: deque[bool] = field(default_factory=deque)
    _failures: int = 0
    consecutive: int = 0

    def record(self, failed: bool) -> str | None:
        """Count one answered record; returns why the budget is exceeded, or None."""
        self._recent.append(failed)
        self._failures += failed
        if len(self._recent) > self.window:
            self._failures -= self._recent.popleft()
        self.consecutive = self.consecutive + 1 if failed else 0
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            return f"{self.consecutive} consecutive failed records (dlq.max_consecutive)"
        if len(self._recent) >= self.window and self._failures / self.window > self.max_ratio:
            return (
                f"{self._failures} of the last {self.window} records failed "
                f"(dlq.max_ratio {self.max_ratio})"
            )
        return None
