"""structlog set-up: JSON lines in production, a console renderer in a terminal."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

from worker.config import LoggingConfig


def configure(cfg: LoggingConfig, **every_line: Any) -> None:
    """``every_line``: fields added to every line, the libraries' too (``run`` adds
    ``pid`` and ``member``, so the lines of ``run --procs N``'s members, which share
    one stream, say whose they are)."""
    level = getattr(logging, cfg.level.upper())
    stamp = _fields(every_line)
    fmt = cfg.format
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            stamp,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # aiokafka (and every other library) logs through the standard library: its
    # records go through the same renderer, so the stream stays one JSON object
    # per line in production. Libraries are kept at WARNING and above.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                stamp,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    handler.addFilter(LibraryLogFilter(shown=level))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))


def _fields(fields: dict[str, Any]) -> structlog.types.Processor:
    def add(_: Any, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
        for key, value in fields.items():
            event.setdefault(key, value)
        return event

    return add


# aiokafka's warning for a topic its metadata does not have (format string).
_MISSING_TOPIC = "Topic %s not found in cluster metadata"

# Library messages that say the group is still forming (a fresh cluster, a new
# group, a coordinator moving): retried by the client, nothing to act on.
_FORMING = ("CoordinatorNotAvailable", "NotCoordinator", "CoordinatorLoadInProgress")


class LibraryLogFilter(logging.Filter):
    """What libraries (aiokafka) log, held to what an operator can act on:

    - a coordinator lookup that failed because the group is still forming is
      logged at info, not error (it is retried; every fresh cluster showed it);
    - a message repeated (same logger, level and text before its arguments) is
      let through at most ``burst`` times per ``interval`` seconds; the first
      let through after a spell says how many were held back. A revoked ACL
      made aiokafka log 302 lines for 20 requests;
    - "Topic X not found in cluster metadata" once per topic.
    """

    def __init__(
        self,
        shown: int = logging.INFO,
        burst: int = 5,
        interval: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._shown = shown
        self._limits: dict[tuple[str, int, str], RateLimited] = {}
        self._missing_topics: set[str] = set()
        self._burst, self._interval, self._clock = burst, interval, clock

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("aiokafka") and record.levelno > logging.INFO:
            text = record.getMessage()
            if any(marker in text for marker in _FORMING):
                record.levelno, record.levelname = logging.INFO, "INFO"
        if record.levelno < self._shown:
            return False
        key = (record.name, record.levelno, str(record.msg))
        if str(record.msg).startswith(_MISSING_TOPIC) and record.args:
            # Once per topic, naming it: aiokafka repeats it for every metadata
            # refresh while a topic is missing (300 lines from one produce).
            topic = str(record.args[0] if isinstance(record.args, tuple) else record.args)
            if topic in self._missing_topics:
                return False
            self._missing_topics.add(topic)
            record.msg = f"{record.msg} (said once per topic; the worker and the tools name it)"
            return True
        limit = self._limits.get(key)
        if limit is None:
            if len(self._limits) >= 1024:  # bounded: forget the oldest spells
                self._limits.clear()
            limit = self._limits[key] = RateLimited(self._burst, self._interval, self._clock)
        held: dict[str, Any] = {}

        def let_through(_: str, **fields: Any) -> None:
            held.update(fields)

        if not limit(let_through, record.name):
            return False
        if "suppressed_since_last" in held:
            record.msg = f"{record.msg} ({held['suppressed_since_last']} more like it held back)"
        return True


class RateLimited:
    """Lets at most ``burst`` events through per ``interval`` seconds; the first
    one let through after a quiet spell reports how many were held back.

    For per-record events (rejected requests): a flood of bad input must not
    become a flood of log lines, but the first of each spell is always seen."""

    def __init__(
        self, burst: int = 10, interval: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._burst = burst
        self._interval = interval
        self._clock = clock
        self._window_start = -float("inf")
        self._sent = 0
        self.suppressed = 0

    def __call__(self, emit: Callable[..., Any], event: str, **fields: Any) -> bool:
        now = self._clock()
        if now - self._window_start >= self._interval:
            self._window_start, self._sent = now, 0
        if self._sent >= self._burst:
            self.suppressed += 1
            return False
        self._sent += 1
        if self.suppressed:
            fields["suppressed_since_last"] = self.suppressed
            self.suppressed = 0
        emit(event, **fields)
        return True
