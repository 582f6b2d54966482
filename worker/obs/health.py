"""Readiness and liveness: what ``/readyz`` and ``/livez`` answer (served by
``worker.obs.http``) and ``infer_ready`` reports. Kept apart from the metrics'
declarations (``worker.obs.metrics`` re-exports every name, where the stages
call them) because it is state with a lock, not a declaration."""

from __future__ import annotations

import threading
import time

from prometheus_client import Gauge

READY = Gauge("infer_ready", "1 while the worker is consuming and producing normally")

_ready = threading.Event()
_conditions: dict[str, bool] = {"started": False}
_lock = threading.Lock()


def set_condition(name: str, ok: bool) -> None:
    """Readiness is the conjunction of named conditions ("started", "broker",
    "delivery"), each owned by one stage; ``/ready`` and ``infer_ready`` follow it."""
    with _lock:
        _conditions[name] = ok
        ready = all(_conditions.values())
    if ready:
        _ready.set()
    else:
        _ready.clear()
    READY.set(1 if ready else 0)


# Liveness: the event loop ticks a monotonic timestamp; the HTTP thread judges it.
_tick = [time.monotonic()]
_live_timeout = [10.0]


def loop_ticked() -> None:
    """Called by the worker's event loop, ten times a second (``service.TICK_S``)."""
    _tick[0] = time.monotonic()


def set_liveness_timeout(seconds: float) -> None:
    _live_timeout[0] = seconds


def loop_stale() -> float | None:
    """Seconds since the last tick when past the timeout, else None."""
    age = time.monotonic() - _tick[0]
    return age if age > _live_timeout[0] else None


def conditions() -> dict[str, bool]:
    with _lock:
        return dict(_conditions)


def is_ready() -> bool:
    return _ready.is_set()
