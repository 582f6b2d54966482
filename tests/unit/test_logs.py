"""Log helpers."""

from __future__ import annotations


def test_rate_limited_lets_a_burst_through_then_reports_what_it_held_back() -> None:
    from worker.logs import RateLimited

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
