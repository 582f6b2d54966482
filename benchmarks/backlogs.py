"""What a drain reads and where its traces go: the backlog of each ``--payload``
(and the worker settings that serve it), and a local OTLP sink. Benchmark code,
not shipped."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from worker.bench.demo import encode_samples, labelled_samples
from worker.contract import Request, Tensor, encode_request


def otlp_sink() -> str:
    """A local HTTP server that takes OTLP trace exports and discards them: the
    exporter's cost is measured, not a collector's. Returns its traces URL."""
    import http.server
    import threading

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1/traces"


def payload(
    kind: str, n: int, tmp: Path, lengths: tuple[int, ...] = ()
) -> tuple[list[tuple[bytes | None, bytes]], dict[str, str]]:
    """The backlog's records and the worker settings that serve them; ``lengths``:
    the tensor payload's id lengths to draw from (default: every one of 1..128)."""
    if kind == "digits":
        samples = labelled_samples(max(1, -(-n // 360)))[:n]
        return encode_samples(samples), {}
    if kind == "text":
        from worker.ops.samples import sentiment_samples

        texts = sentiment_samples(max(1, -(-n // 400)))[:n]
        records: list[tuple[bytes | None, bytes]] = [
            (t.id.encode(), encode_request(Request(v=1, id=t.id, inputs={"text": t.text})))
            for t in texts
        ]
        return records, {"INFER_WORKER_MODEL__PATH": "builtin:sentiment"}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.onnx_models import ranker

    path = ranker(tmp / "ranker.onnx")
    rng = np.random.default_rng(0)

    def length(rng: np.random.Generator) -> int:
        return int(rng.choice(lengths)) if lengths else int(rng.integers(1, 129))

    records = []
    for i in range(n):
        inputs = {
            "features": Tensor.from_numpy(rng.normal(size=4).astype(np.float32)),
            "ids": Tensor.from_numpy(rng.integers(1, 50, length(rng)).astype(np.int64)),
        }
        records.append((str(i).encode(), encode_request(Request(v=1, id=str(i), inputs=inputs))))
    env = {
        "INFER_WORKER_MODEL__PATH": str(path),
        "INFER_WORKER_MODEL__INPUTS__IDS__MAX_LENGTH": "128",
    }
    return records, env
