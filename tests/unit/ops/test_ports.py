"""Ports for the worker processes the tools start: consecutive, free, and out of
the range the kernel hands to outgoing connections (which took a --procs
member's metrics port once in CI)."""

from __future__ import annotations

import socket

import pytest

from worker.ops.broker import _ephemeral_low, free_port, port_is_free


def test_consecutive_free_ports_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    for count in (1, 2, 8):
        first = free_port(count)
        assert first >= 10_000 and first + count <= low
        assert all(port_is_free(p) for p in range(first, first + count))


def test_a_taken_port_is_not_free() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])


def test_ports_handed_out_lately_are_not_handed_out_again() -> None:
    """Free when checked, bound by their user a moment later: a port handed out
    is not handed out again meanwhile, even if its user has not bound it yet."""
    handed = [free_port(3) for _ in range(200)]
    spans = [p for first in handed for p in range(first, first + 3)]
    assert len(set(spans)) == len(spans)


def test_each_test_process_chooses_in_a_share_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under pytest-xdist, worker K of N picks ports in the K-th of N parts of
    the range: two test processes never hand out the same port."""
    from worker.ops.broker import _share

    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    parts = []
    for k in (0, 1):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{k}")
        parts.append(_share(10_000, 32_000))
        start, stop = _share(10_000, max(10_001, _ephemeral_low() - 1))  # free_port's
        assert all(start <= free_port() < stop for _ in range(20))
    assert parts == [(10_000, 21_000), (21_000, 32_000)]
