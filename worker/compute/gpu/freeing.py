"""Freeing device memory while the process's other GPU stages serve (a model
evicted by demand, ``GpuStage.evict``).

Every chunk a stage submits ends with a host function on its slot's stream
(``launch``: the completion wake-up), which CUDA runs on a driver thread and
which takes the GIL. Freeing memory with ``cudaFree`` (what TensorRT does as an
execution context or an engine is destroyed, and CuPy as blocks go back to the
device) synchronises the whole device, with the GIL held by the Python call
that dropped the object: a host function still queued on another stage's
stream would wait for the GIL for ever, and so would the free. Shutdown avoids
it by draining the device first while no stage submits (``GpuStage.close``);
an eviction cannot stop the other models, so it shuts them out for a moment
instead: submissions hold this gate shared (many at once, a few microseconds
each), a freeing holds it alone, so once the submissions under way have
finished and the device has drained (with the GIL released), nothing can queue
a host function until the memory is freed.

One gate per process: the GIL it works around is the process's. Only a real
GPU can deadlock so; the CPU twin runs each host function at once, so its
tests check the gate's exclusion, not the deadlock it prevents.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class FreeingGate:
    """Submissions shared, freeing exclusive; a freeing waiting shuts out new
    submissions (so a steady stream of them cannot starve it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._submitting = 0
        self._freeing = False

    @contextlib.contextmanager
    def submitting(self) -> Iterator[None]:
        """Around one submission's enqueueing (a stage thread)."""
        with self._cond:
            while self._freeing:
                self._cond.wait()
            self._submitting += 1
        try:
            yield
        finally:
            with self._cond:
                self._submitting -= 1
                if not self._submitting:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def freeing(self) -> Iterator[None]:
        """Around draining the device and freeing: entered once no submission is
        under way; none starts until it is left."""
        with self._cond:
            while self._freeing:
                self._cond.wait()
            self._freeing = True
            while self._submitting:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._freeing = False
                self._cond.notify_all()

    @property
    def submissions(self) -> int:
        """Submissions under way now (for tests)."""
        with self._cond:
            return self._submitting


GATE = FreeingGate()
"""The process's gate: every GPU stage's launcher and every eviction use it."""
