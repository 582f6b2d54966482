"""Counts the Kafka requests a process sends, by type (issue 36's fetch and produce
requests per 1,000 records). Put this folder on ``PYTHONPATH`` and set
``REQUEST_COUNTS`` to a path prefix: each process writes ``PREFIX.PID`` (JSON)
when it exits. Benchmark code, not shipped."""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time
from typing import Any

from aiokafka import conn as _conn

_counts: collections.Counter[str] = collections.Counter()
_send = _conn.AIOKafkaConnection.send


def _counting_send(self: Any, request: Any, expect_response: bool = True) -> Any:
    _counts[type(request).__name__.split("_")[0]] += 1
    return _send(self, request, expect_response)


_conn.AIOKafkaConnection.send = _counting_send  # type: ignore[method-assign]


def _every_second() -> None:
    """A process killed with SIGKILL (benchmarks.lanes' workers) never runs atexit."""
    while True:
        time.sleep(1.0)
        _dump()


@atexit.register
def _dump() -> None:
    prefix = os.environ.get("REQUEST_COUNTS")
    if prefix:
        with open(f"{prefix}.{os.getpid()}", "w") as fh:
            json.dump(dict(_counts), fh)


if os.environ.get("REQUEST_COUNTS"):
    threading.Thread(target=_every_second, daemon=True).start()
