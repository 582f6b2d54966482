"""Waiting between retries, and time budgets over a chain of calls: one of each.

``Backoff`` is the jittered exponential every retry loop uses (the at-least-once
writer redelivering through an outage, the exactly-once writer after an aborted
transaction, a producer being replaced, the consumer after a failed fetch).
Jitter, because twenty workers that lost the broker together must not all come
back to it in the same instant. ``Deadline`` is a budget over several steps (a
drain, then a commit, then closing clients), read on the monotonic clock.
Pure: they say how long; the caller sleeps.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Delays that start at ``first`` seconds and double up to ``cap``, each
    scaled by a random factor in ``jitter`` (1.0 to 1.0 for none)."""

    def __init__(
        self,
        first: float,
        cap: float = 10.0,
        jitter: tuple[float, float] = (0.75, 1.25),
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"backoff: need 0 < first ({first}) <= cap ({cap})")
        self._first = first
        self._cap = cap
        self._jitter = jitter
        self._uniform = uniform
        self._current = first

    @property
    def current(self) -> float:
        """The next delay before jitter (for logs)."""
        return self._current

    def next(self) -> float:
        """The delay to wait now; the one after it doubles (up to the cap)."""
        delay = self._current * self._uniform(*self._jitter)
        self._current = min(self._current * 2, self._cap)
        return delay

    def reset(self) -> None:
        """After a success: the next failure waits ``first`` again."""
        self._current = self._first
