"""The metrics port's HTTP server: ``/metrics`` (Prometheus text format),
``/livez`` and ``/readyz`` (``worker.obs.metrics`` keeps the metrics, the
readiness conditions and the loop's liveness tick; see its docstring), and the
Open Inference Protocol's ``/v2`` model endpoints (``worker.obs.served``) and its
model repository extension (``worker.obs.repository``, POST)."""

from __future__ import annotations

import errno
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from worker.flow.errors import ConfigError
from worker.obs import metrics, repository, served


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif path in ("/livez", "/healthz"):
            stale = metrics.loop_stale()
            if stale is None:
                self._reply(200, b"ok\n")
            else:
                self._reply(503, f"event loop has not ticked for {stale:.1f}s\n".encode())
        elif path == "/v2" or path.startswith("/v2/"):
            code, body = served.answer(path)
            self._reply(code, body, served.JSON)
        elif path in ("/readyz", "/ready"):
            ok = metrics.is_ready()
            failing = ", ".join(k for k, v in metrics.conditions().items() if not v)
            body = b"ready\n" if ok else f"not ready: {failing}\n".encode()
            self._reply(200 if ok else 503, body)
        else:
            self._reply(404, b"not found\n")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            length = max(0, int(self.headers.get("Content-Length") or 0))
        except ValueError:
            length = 0
        body = self.rfile.read(min(length, 65536)) if length else b""
        if path.startswith("/v2/repository/"):
            code, answer = repository.answer(path, body)
            self._reply(code, answer, repository.JSON)
        else:
            self._reply(404, b"not found\n")

    def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Probes every few seconds would flood the worker's log."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A prober that hung up before its answer was written (a scrape or a
        test's poll timing out) is not the worker's error: socketserver would
        print a traceback to stderr for each one."""
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


def serve_http(port: int, host: str) -> ThreadingHTTPServer:
    """Serve /metrics, /healthz and /ready from a daemon thread.

    A port already taken (a second worker on the same host) is a configuration
    error naming the setting, not a traceback."""
    try:
        server = _Server((host, port), _Handler)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ConfigError(
            f"metrics.port: {host}:{port} is already in use (another worker on this host?); "
            "set INFER_WORKER_METRICS__PORT to a free port, or 0 to serve no metrics"
        ) from exc
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
