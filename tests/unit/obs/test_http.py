"""The metrics port's HTTP server (worker/obs/http.py)."""

from __future__ import annotations

import http.client

import pytest

from worker.obs.http import serve_http


def test_a_prober_hanging_up_is_not_reported_but_other_errors_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = serve_http(0, "127.0.0.1")
    try:
        port = server.server_address[1]
        # Serving: /livez answers (503 here: no event loop ticks in this test).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/livez")
        assert conn.getresponse().status in (200, 503)
        conn.close()
        for gone in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")):
            try:
                raise gone
            except OSError:
                server.handle_error(None, ("127.0.0.1", 1))
        assert capsys.readouterr().err == ""
        try:
            raise ValueError("a bug in a handler")
        except ValueError:
            server.handle_error(None, ("127.0.0.1", 1))
        assert "a bug in a handler" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
