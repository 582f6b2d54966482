"""structlog set-up: JSON lines in production, a console renderer in a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from worker.config import LoggingConfig


def configure(cfg: LoggingConfig) -> None:
    level = getattr(logging, cfg.level.upper())
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
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # aiokafka logs through stdlib logging: keep its warnings, in the same stream.
    logging.basicConfig(
        level=max(level, logging.WARNING),
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
