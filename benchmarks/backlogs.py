"""What a drain reads and where its traces go: the backlog of each ``--payload``
(and the worker settings that serve it), and a local OTLP sink. Benchmark code,
not shipped."""

from __future__ import annotations

import sys
from collections.abc import Callable
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


def avro_backlog(
    records: list[tuple[bytes | None, bytes]], registry_url: str, subject: str
) -> list[tuple[bytes | None, bytes]]:
    """The same requests in the Schema Registry's Avro format: tensors as flat arrays
    of their item type (the model input's shape), texts as strings; the schema
    registered under ``subject``. Tensors and texts only (an image's pixels have no
    Avro form the worker reads as pixels)."""
    import io

    import fastavro

    from worker.config import SchemaRegistryConfig
    from worker.contract import decode_request
    from worker.kafka.registry import SchemaRegistry

    items = {"float32": "float", "float64": "double", "int32": "int", "int64": "long"}
    first = decode_request(records[0][1])
    fields: list[dict[str, object]] = [{"name": "id", "type": "string"}]
    for name, value in first.inputs.items():
        if isinstance(value, str):
            fields.append({"name": name, "type": "string"})
        elif isinstance(value, Tensor) and value.dtype in items:
            fields.append({"name": name, "type": {"type": "array", "items": items[value.dtype]}})
        else:
            raise SystemExit(f"--avro: input {name!r} has no Avro form here (tensors, texts)")
    schema = {"type": "record", "name": "DrainRequest", "fields": fields}
    sid = SchemaRegistry(SchemaRegistryConfig(url=registry_url)).register(subject, schema)
    parsed = fastavro.parse_schema(schema)
    out: list[tuple[bytes | None, bytes]] = []
    for key, value in records:
        request = decode_request(value)
        record: dict[str, object] = {"id": request.id}
        for name, given in request.inputs.items():
            flat = given if isinstance(given, str) else given.to_numpy().reshape(-1).tolist()
            record[name] = flat
        buf = io.BytesIO()
        buf.write(b"\x00" + sid.to_bytes(4, "big"))
        fastavro.schemaless_writer(buf, parsed, record)
        out.append((key, buf.getvalue()))
    return out


def avro_status(registry_url: str) -> Callable[[bytes], str]:
    """A result's status read from its Avro bytes, with the schema of its id."""
    import io
    import json

    import fastavro

    from worker.config import SchemaRegistryConfig
    from worker.kafka.registry import SchemaRegistry

    registry = SchemaRegistry(SchemaRegistryConfig(url=registry_url))
    parsed: dict[int, object] = {}

    def status(value: bytes) -> str:
        sid = int.from_bytes(value[1:5], "big")
        if sid not in parsed:
            parsed[sid] = fastavro.parse_schema(json.loads(registry.schema(sid)[1]))
        return str(fastavro.schemaless_reader(io.BytesIO(value[5:]), parsed[sid], None)["status"])

    return status
