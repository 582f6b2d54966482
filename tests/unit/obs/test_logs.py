"""Log helpers."""

from __future__ import annotations

import logging


def test_rate_limited_lets_a_burst_through_then_reports_what_it_held_back() -> None:
    from worker.obs.logs import RateLimited

    now = [0.0]
    limit = RateLimited(burst=2, interval=10.0, clock=lambda: now[0])
    seen: list[dict[str, object]] = []

    def emit(event: str, **fields: object) -> None:
        seen.append({"event": event, **fields})

    assert [limit(emit, "x", n=i) for i in range(5)] == [True, True, False, False, False]
    now[0] = 10.0
    assert limit(emit, "x", n=5)
    assert [s["n"] for s in seen] == [0, 1, 5]
    assert seen[-1]["suppressed_since_last"] == 3 and "suppressed_since_last" not in seen[0]


def test_library_log_records_come_out_as_json_lines(capsys: object) -> None:
    """aiokafka logs through the standard library; with ``format = "json"`` its
    lines must be JSON objects like the worker's own (issue 13)."""
    import json
    import logging

    import pytest
    import structlog

    from worker.config import LoggingConfig
    from worker.obs.logs import configure

    assert isinstance(capsys, pytest.CaptureFixture)
    try:
        configure(LoggingConfig(format="json", level="info"))
        logging.getLogger("aiokafka.consumer").warning("heartbeat failed: %s", "Error 15")
        structlog.get_logger("worker").info("own_event", n=1)
        logging.getLogger("aiokafka").info("below the library threshold")
        lines = capsys.readouterr().err.strip().splitlines()
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    events = [json.loads(line) for line in lines]  # every line is JSON
    assert len(events) == 2
    foreign, own = events
    assert foreign["event"] == "heartbeat failed: Error 15"
    assert foreign["level"] == "warning" and foreign["logger"] == "aiokafka.consumer"
    assert "timestamp" in foreign and own["event"] == "own_event"


def test_every_line_carries_the_process_and_member_fields(capsys: object) -> None:
    """Issue 56: ``run --procs N``'s members share one stream; every line, the
    libraries' too, says which process and member wrote it."""
    import json

    import pytest
    import structlog

    from worker.config import LoggingConfig
    from worker.obs.logs import configure

    assert isinstance(capsys, pytest.CaptureFixture)
    try:
        configure(LoggingConfig(format="json", level="info"), pid=4242, member="infer-worker-1")
        structlog.get_logger("worker").info("own_event")
        logging.getLogger("aiokafka.consumer").warning("heartbeat failed")
        structlog.get_logger("worker").info("bound", member="explicit")  # a field given wins
        lines = capsys.readouterr().err.strip().splitlines()
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    events = [json.loads(line) for line in lines]
    assert [(e["pid"], e["member"]) for e in events] == [
        (4242, "infer-worker-1"), (4242, "infer-worker-1"), (4242, "explicit"),
    ]  # fmt: skip


def test_liveness_fails_once_the_loop_stops_ticking() -> None:
    import time

    from worker.obs import metrics

    metrics.set_liveness_timeout(0.05)
    try:
        metrics.loop_ticked()
        assert metrics.loop_stale() is None
        time.sleep(0.1)
        stale = metrics.loop_stale()
        assert stale is not None and stale >= 0.1
        metrics.loop_ticked()
        assert metrics.loop_stale() is None
    finally:
        metrics.set_liveness_timeout(10.0)


def _record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_repeated_library_message_is_held_to_a_few_lines_with_a_count() -> None:
    """A revoked ACL made aiokafka log one line per failed request (302 for 20
    requests): the same message is let through a few times per interval, and the
    next one through says how many were held back."""
    from worker.obs.logs import LibraryLogFilter

    now = [0.0]
    f = LibraryLogFilter(shown=logging.INFO, burst=3, interval=30.0, clock=lambda: now[0])
    msg = "Got error produce response: %s"
    passed = [f.filter(_record("aiokafka.producer.sender", logging.WARNING, msg, i))
              for i in range(300)]  # fmt: skip
    assert passed.count(True) == 3 and passed[:3] == [True] * 3
    other = _record("aiokafka.conn", logging.WARNING, "another message")
    assert f.filter(other)  # another message has its own allowance
    now[0] = 31.0
    later = _record("aiokafka.producer.sender", logging.WARNING, msg, "x")
    assert f.filter(later)
    assert later.getMessage() == "Got error produce response: x (297 more like it held back)"


def test_a_coordinator_still_forming_is_info_not_error() -> None:
    from worker.obs.logs import LibraryLogFilter

    forming = _record("aiokafka.consumer.group_coordinator", logging.ERROR,
                      "Group Coordinator Request failed: %s",
                      "[Error 15] CoordinatorNotAvailableError")  # fmt: skip
    assert not LibraryLogFilter(shown=logging.WARNING).filter(forming)
    assert forming.levelname == "INFO"
    forming.levelno, forming.levelname = logging.ERROR, "ERROR"
    assert LibraryLogFilter(shown=logging.INFO).filter(forming)
    assert forming.levelname == "INFO"
    refused = _record("aiokafka.consumer.group_coordinator", logging.ERROR,
                      "Group Coordinator Request failed: %s",
                      "[Error 30] GroupAuthorizationFailedError")  # fmt: skip
    assert LibraryLogFilter(shown=logging.WARNING).filter(refused)
    assert refused.levelname == "ERROR"


def test_a_missing_topic_is_said_once_per_topic_naming_it() -> None:
    """aiokafka logs "Topic X not found in cluster metadata" at every metadata
    refresh while X is missing (about 300 lines from one produce to a misspelt
    topic, issue 56): once per topic, then the worker's or the tool's own message."""
    from worker.obs.logs import LibraryLogFilter

    f = LibraryLogFilter()
    fmt = "Topic %s not found in cluster metadata"
    passed = [r for r in (_record("aiokafka.cluster", logging.ERROR, fmt, t)
                          for t in ["a.typo"] * 300 + ["b.typo"] * 5) if f.filter(r)]  # fmt: skip
    assert [r.getMessage().split(" (")[0] for r in passed] == [
        "Topic a.typo not found in cluster metadata", "Topic b.typo not found in cluster metadata",
    ]  # fmt: skip
