"""Times every event-loop callback by what it runs (a ``sitecustomize``).

Put this file's folder, with the file named ``sitecustomize.py``, on the
worker's ``PYTHONPATH`` and set ``HANDLE_TIMES`` to a path prefix: every 2 s
the process writes ``PREFIX.PID`` (JSON), for each callback (a task's coroutine
or a function): [count, total s, max s, count over 1 ms, count over 3 ms].
Wraps ``asyncio.events.Handle._run``. Benchmark code, not shipped.
"""

import asyncio.events as ev
import collections
import json
import os
import threading
import time
from typing import Any

_OUT = os.environ.get("HANDLE_TIMES")


def _name(handle: Any) -> str:
    callback = handle._callback
    owner = getattr(callback, "__self__", None)
    if owner is not None and hasattr(owner, "get_coro"):
        coro = owner.get_coro()
        return "task:" + getattr(coro, "__qualname__", repr(coro))
    return getattr(callback, "__qualname__", repr(callback))


if _OUT:
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
    _run = ev.Handle._run

    def _timed(self: Any) -> None:
        start = time.perf_counter()
        try:
            _run(self)
        finally:
            took = time.perf_counter() - start
            s = stats[_name(self)]
            s[0] += 1
            s[1] += took
            s[2] = max(s[2], took)
            s[3] += took > 0.001
            s[4] += took > 0.003

    ev.Handle._run = _timed  # type: ignore[method-assign]

    def _dump() -> None:
        while True:
            time.sleep(2)
            with open(f"{_OUT}.{os.getpid()}", "w") as fh:
                json.dump(dict(list(stats.items())), fh)

    threading.Thread(target=_dump, daemon=True).start()
