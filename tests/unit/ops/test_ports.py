"""Ports for the worker processes the tools start: consecutive, free, and out of
the range the kernel hands to outgoing connections (which took a --procs
member's metrics port once in CI)."""

from __future__ import annotations

import socket

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
