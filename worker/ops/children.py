"""Every process a tool starts ends with it, however the tool is stopped.

``bench``, ``demo``, the sweep and the repository's bench scripts start the
embedded broker and worker processes; ``run --procs N`` starts members of its
own, each in a session of its own (so Ctrl-C in a terminal reaches the
supervisor alone). A benchmark stopped by ``timeout`` or by an orchestrator
must not leave any of them running into the next measurement, where they would
share the GPU, the cores and the ports. Measured before this module existed
(``bench --model digits --procs 2``): SIGTERM to the tool left the broker, the
supervisor and both members running; SIGINT left both members (the tool's
cleanup SIGKILLed the supervisor, which orphaned them); under ``timeout`` (a
SIGTERM to the whole process group) all of them outlived the tool by seconds
while they drained.

How, and why this way: on SIGTERM or SIGINT the tool freezes (SIGSTOP) and
then SIGKILLs its whole tree of descendants, found through ``/proc`` by parent
pid, waits until each is gone, and exits at once with 128 + the signal.

- The tree, not the process group: the supervisor's members are in other
  sessions, out of reach of a group signal, but still its children.
- Freezing first: a process stopped cannot fork, so the tree read after the
  freeze is complete (a supervisor mid-start cannot add a member unseen), and
  a member cannot react to its siblings' deaths.
- Exiting at once (``os._exit``) rather than raising into the tool: the main
  thread may be waiting on a thread that compiles a model for minutes, and
  ``asyncio.run`` would wait for it with the GPU held; everything the tool
  owns is gone with the process, and results files are written atomically.
- Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started a child
  ends (children started from ``asyncio.to_thread`` would die early), needs a
  ``preexec_fn`` (unsafe in a process with threads, as these tools are), and
  the supervisor's members, started by the worker itself, would not carry it.

Not covered: a tool killed with SIGKILL cannot act; its children then live on
(the supervisor's members too, unless the supervisor itself is signalled).
Linux only (``/proc``); elsewhere the handler kills nothing and just exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import FrameType

from worker.flow.deadline import Deadline

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...), None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split(maxsplit=1)[0].decode()


def _parents() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process visible now."""
    out: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # gone since the listing
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before their children."""
    parents, out, todo = _parents(), [], [pid]
    while todo:
        for child in parents.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Running or stopped; a zombie has released everything but its pid."""
    return _state(pid) not in (None, "Z", "X")


def _signal(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def kill_tree(root: int, *, include_root: bool = True, timeout: float = 5.0) -> list[int]:
    """SIGKILL ``root`` (unless ``include_root`` is false: the caller itself) and
    all its descendants, frozen first so that none can start another unseen;
    returns once each is gone or a zombie, or after ``timeout`` seconds. Returns
    the pids killed."""
    frozen: list[int] = []
    if include_root and alive(root):
        _signal([root], signal.SIGSTOP)
        frozen.append(root)
    while True:  # until the tree read after a freeze holds nothing new
        new = [p for p in descendants(root) if p not in frozen]
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        frozen += new
    _signal(frozen, signal.SIGKILL)
    budget = Deadline(timeout)
    while any(alive(p) for p in frozen) and not budget.expired:
        time.sleep(0.01)
    return frozen


def _stop_handler(name: str) -> Callable[[int, FrameType | None], None]:
    def stop(signum: int, _: FrameType | None) -> None:
        killed = kill_tree(os.getpid(), include_root=False)
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # mid-write: keep going
            sys.stdout.flush()
        note = (
            f"\n{name}: stopped by {signal.Signals(signum).name}; "
            f"{len(killed)} child process(es) killed\n"
        )
        with contextlib.suppress(OSError):
            os.write(2, note.encode())
        os._exit(128 + signum)

    return stop


@contextlib.contextmanager
def children_die_with_this_process(
    name: str, signals: Sequence[signal.Signals] = STOP_SIGNALS
) -> Iterator[None]:
    """While inside: SIGTERM or SIGINT kills every descendant of this process,
    then ends it with status 128 + the signal (see the module docstring). The
    previous handlers come back on leaving. Outside the main thread (where
    Python cannot set handlers) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _stop_handler(name)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
