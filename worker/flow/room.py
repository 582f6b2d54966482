"""Room on the engine: how many batches may be cut and not yet finished.

A batch is cut only when the engine can start it (a CPU thread with its
buffers, a GPU slot is free), as Triton's dynamic batcher forms a batch when a
model instance is idle. Cut earlier, a batch waits in the queues between the
batcher, the stage and the writer with its rows already chosen: under load that
was up to seven batches, and a priority lane's request that arrived meanwhile
waited behind all of them (issue 39). Cut late, the requests that arrived while
the engine was busy are in the policy when the next batch is formed, so the
most urgent lane's go first, and a batch holds every row that is ready.

The batcher takes room before cutting; the stage gives it back when the batch's
future is done (its answers complete, whatever became of them).
"""

from __future__ import annotations

import asyncio
from typing import Any


class Room:
    """``size`` batches between being cut and being done, at most."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"room: size must be >= 1, got {size}")
        self.size = size
        self._used = 0
        self._freed = asyncio.Event()

    @property
    def free(self) -> bool:
        return self._used < self.size

    def take(self) -> None:
        """One batch cut (the caller checked ``free``)."""
        assert self.free, "Room.take without room"
        self._used += 1

    def give_back(self, _done: Any = None) -> None:
        """One batch done; usable as a future's done callback."""
        self._used -= 1
        self._freed.set()

    async def wait(self) -> None:
        """Until a batch could be cut."""
        while not self.free:
            self._freed.clear()
            await self._freed.wait()
