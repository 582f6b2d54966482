"""End of stream between stages.

Stages are linked by bounded queues and signal the end of their output with
``None``, so shutdown drains stage by stage. How that ``None`` is put depends on
why the stage ends, and getting it wrong hangs ``Worker.stop()``; so it lives here,
once, for every stage.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any


@contextlib.asynccontextmanager
async def end_of_stream(queue: asyncio.Queue[Any]) -> AsyncIterator[None]:
    """Put ``None`` into ``queue`` when the block ends.

    Normal end or a failure: wait for room, so downstream drains everything.
    Cancelled (drain deadline passed, second signal): downstream is being
    cancelled too or is stuck, so only put it if there is room right now; a
    blocking put into a full queue would never return.
    """
    try:
        yield
    except asyncio.CancelledError:
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(None)
        raise
    except BaseException:
        await queue.put(None)
        raise
    await queue.put(None)
