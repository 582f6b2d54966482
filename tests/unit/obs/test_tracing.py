"""W3C trace context: what a request carries is parsed strictly, and an answer's
headers name a child span of it (same trace, new span, same flags and state)."""

from __future__ import annotations

import pytest

from worker.flow.messages import TraceContext
from worker.obs.tracing import Tracer, parse

PARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_traceparent_and_its_state_are_read() -> None:
    ctx = parse([("id", b"x"), ("traceparent", PARENT), ("tracestate", b"congo=t61rcWkgMzE")])
    assert ctx == TraceContext(
        "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01", b"congo=t61rcWkgMzE"
    )


@pytest.mark.parametrize(
    "value",
    [
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
        b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
        b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # 00 takes no more
        b"00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
        b"\xff\xfe",
    ],
)
def test_a_malformed_traceparent_is_ignored(value: bytes) -> None:
    assert parse([("traceparent", value)]) is None


def test_a_later_version_is_read_for_its_first_fields() -> None:
    ctx = parse([("traceparent", b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x")])
    assert ctx is not None and ctx.parent_id == "00f067aa0ba902b7"


def test_an_answer_is_a_child_span_of_the_request() -> None:
    ctx = parse([("traceparent", PARENT), ("tracestate", b"a=1")])
    child = Tracer().span(ctx, {}, [], 0, 1)
    assert child is not None and child.trace_id == ctx.trace_id if ctx else False
    assert child.parent_id != ctx.parent_id and len(child.parent_id) == 16  # type: ignore[union-attr]
    headers = dict(child.headers())
    assert headers["traceparent"].decode().startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert headers["traceparent"].decode().endswith("-01") and headers["tracestate"] == b"a=1"
    assert Tracer().span(None, {}, [], 0, 1) is None  # no context: nothing to carry
