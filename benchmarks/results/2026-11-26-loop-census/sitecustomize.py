"""How many event-loop iterations and handles a process runs, and which: put
this folder on PYTHONPATH with LOOPCOUNT=1, and each Python process writes
/tmp/loopcount/out-PID.txt at exit. Used for one digits drain (BENCHMARKS.md,
issue 36):

    LOOPCOUNT=1 PYTHONPATH=benchmarks/results/2026-11-26-loop-census \
        .venv/bin/python -m bench.drain --broker embedded --records 30000 --repeat 1 --peers
"""

import atexit
import collections
import contextlib
import os
from asyncio import base_events

_run_once = base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]
counts = [0, 0]
handles: collections.Counter[str] = collections.Counter()


def _counted(self):  # type: ignore[no-untyped-def]
    counts[0] += 1
    counts[1] += len(self._ready)
    for handle in list(self._ready)[:50]:
        callback = getattr(handle, "_callback", None)
        name = getattr(callback, "__qualname__", None) or type(callback).__name__
        owner = getattr(callback, "__self__", None)
        if owner is not None and hasattr(owner, "get_coro"):
            with contextlib.suppress(Exception):
                name = "task:" + owner.get_coro().__qualname__
        handles[name] += 1
    return _run_once(self)


def _dump() -> None:
    os.makedirs("/tmp/loopcount", exist_ok=True)
    with open(f"/tmp/loopcount/out-{os.getpid()}.txt", "w") as out:
        out.write(f"iterations {counts[0]} handles {counts[1]}\n")
        for name, n in handles.most_common(40):
            out.write(f"{n} {name}\n")


if os.environ.get("LOOPCOUNT"):
    base_events.BaseEventLoop._run_once = _counted  # type: ignore[attr-defined]
    atexit.register(_dump)
