"""Open Inference Protocol v2 JSON on Kafka, beside msgpack, and W3C trace context,
with real worker processes on both brokers:

- a JSON request (header ``content-type: application/json``) gets a JSON answer
  with that header, only the outputs it named; a malformed one a JSON error
  answer; a value that is not JSON at all goes to the DLQ; msgpack requests on
  the same topic are answered in msgpack as before;
- with ``kafka.content_type = "application/json"`` records without a header are
  read as JSON; image files (base64) and texts travel as BYTES;
- a request's ``traceparent`` reaches its result and its DLQ record as a child
  span (same trace id, a new span id), in both formats; with ``tracing.enabled``
  the worker exports that span over OTLP/HTTP to a collector (a real HTTP
  server here decoding the OTLP protobuf);
- the README's kcat one-liner gets an answer.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from tests.documentation import documentation
from tests.images import encode
from tests.onnx_models import ranker, run_alone
from tests.required_tools import binary
from worker.contract import Request, Tensor, decode_result, encode_request
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collected, Collector, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")

JSON = [("content-type", b"application/json")]
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE = [("traceparent", PARENT.encode()), ("tracestate", b"vendor=1")]


async def produce_with_headers(
    broker: Broker, topic: str, records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]]
) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    await producer.start()
    try:
        sent = [await producer.send(topic, value, key=key, headers=headers)
                for key, value, headers in records]  # fmt: skip
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def run_worker(broker: Broker, names: dict[str, str], env: dict[str, str]) -> WorkerProcess:
    await create_topics(broker.bootstrap, {names["requests"]: 1, names["results"]: 1,
                                           names["dlq"]: 1})  # fmt: skip
    w = spawn_worker(
        broker.bootstrap, input_topics=[names["requests"]], output_topic=names["results"],
        dlq_topic=names["dlq"], group_id=names["group"], extra_env=env,
    )  # fmt: skip
    await asyncio.to_thread(
        w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 1, 60.0, "assignment"
    )
    return w


async def collect(
    broker: Broker, names: dict[str, str], n: int
) -> tuple[list[Collected], list[Collected]]:
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    await c.start()
    try:
        assert await c.collect(lambda c: c.count() >= n, 60.0), f"{c.count()} of {n} answered"
    finally:
        await c.stop()
    return c.records.get(names["results"], []), c.records.get(names["dlq"], [])


def oip_ranker(rid: str, features: np.ndarray, ids: np.ndarray, **extra: Any) -> bytes:
    return json.dumps({
        "id": rid,
        "inputs": [
            {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": features.tolist()},
            {"name": "ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids.tolist()},
        ],
        **extra,
    }).encode()  # fmt: skip


async def test_json_and_msgpack_requests_on_one_topic_with_trace_context(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    path = ranker(tmp_path / "ranker.onnx")
    features, ids = np.array([1, 2, 3, 4], np.float32), np.array([5, 6, 7], np.int64)
    alone = run_alone(path, {"features": features, "ids": ids})
    msgpack_request = encode_request(Request(v=1, id="mp", inputs={
        "features": Tensor.from_numpy(features), "ids": Tensor.from_numpy(ids)}))  # fmt: skip
    records = [
        (b"a", oip_ranker("json-all", features, ids, parameters={"tenant": "t1"}), JSON + TRACE),
        (b"b", oip_ranker("json-one", features, ids, outputs=[{"name": "score"}]), JSON),
        (b"c", b'{"id": "bad", "inputs": [{"name": "features"}]}', JSON + TRACE),
        (b"d", b"this is not json", JSON + TRACE),
        (b"e", msgpack_request, TRACE),
        (b"f", oip_ranker("json-ghost", features, ids, outputs=[{"name": "nope"}]), JSON),
    ]
    w = await run_worker(broker, names, {"INFER_WORKER_MODEL__PATH": str(path)})
    try:
        await produce_with_headers(broker, names["requests"], records)
        results, dlq = await collect(broker, names, len(records))
    finally:
        assert w.terminate() == 0, w.log_tail()
    by_key = {r.record_key: r for r in results}

    ok = by_key[b"a"]
    assert ok.headers["content-type"] == b"application/json" and ok.headers["id"] == b"json-all"
    answer = json.loads(ok.value)
    assert answer["id"] == "json-all" and answer["model_name"] == "ranker"
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["score"]["shape"] == [1, 1] and outputs["score"]["datatype"] == "FP32"
    np.testing.assert_allclose(outputs["score"]["data"], alone["score"], rtol=1e-5, atol=1e-6)
    assert outputs["token_scores"]["shape"] == [1, 3]  # the request's own length
    params = answer["parameters"]
    assert params["status"] == "ok" and params["meta"] == {"tenant": "t1"}
    assert params["source"]["topic"] == names["requests"]

    assert [o["name"] for o in json.loads(by_key[b"b"].value)["outputs"]] == ["score"]
    bad = json.loads(by_key[b"c"].value)
    assert bad["id"] == "bad" and bad["parameters"]["code"] == "invalid_request"
    assert "inputs.features.shape: missing" in bad["error"]
    ghost = json.loads(by_key[b"f"].value)
    assert ghost["parameters"]["code"] == "invalid_request" and "nope" in ghost["error"]

    plain = by_key[b"e"]  # msgpack in, msgpack out
    assert "content-type" not in plain.headers and decode_result(plain.value).status == "ok"

    (dead,) = dlq
    assert dead.value == b"this is not json" and dead.headers["error.code"] == b"undecodable"

    # Trace context: a child span of the request's, on results and DLQ records alike.
    for record in (ok, by_key[b"c"], plain, dead):
        version, trace_id, span_id, flags = record.headers["traceparent"].decode().split("-")
        assert (version, trace_id, flags) == ("00", PARENT.split("-")[1], "01")
        assert span_id != PARENT.split("-")[2] and len(span_id) == 16
        assert record.headers["tracestate"] == b"vendor=1"
    assert "traceparent" not in by_key[b"b"].headers  # none came: none is made up


async def test_json_by_default_images_and_texts_as_bytes(
    broker: Broker, names: dict[str, str]
) -> None:
    from worker.ops.samples import labelled_samples

    sample = labelled_samples(1)[0]
    png = base64.b64encode(encode(sample.image, "PNG")).decode()
    as_file = {"name": "image", "shape": [1], "datatype": "BYTES", "data": [png],
               "parameters": {"content_type": "base64"}}  # fmt: skip
    as_pixels = {"name": "image", "shape": [1, 8, 8, 1], "datatype": "UINT8",
                 "data": sample.image.reshape(-1).tolist()}  # fmt: skip
    image = json.dumps({"id": "img", "inputs": [as_file]}).encode()
    pixels = json.dumps({"id": "px", "inputs": [as_pixels]}).encode()
    env = {"INFER_WORKER_KAFKA__CONTENT_TYPE": "application/json"}
    w = await run_worker(broker, names, env)
    try:
        await produce_all(broker.bootstrap, names["requests"], [(b"1", image), (b"2", pixels)])
        results, _ = await collect(broker, names, 2)
    finally:
        assert w.terminate() == 0, w.log_tail()
    answers = {json.loads(r.value)["id"]: json.loads(r.value) for r in results}
    for rid in ("img", "px"):
        top = {o["name"]: o["data"] for o in answers[rid]["outputs"]}["topk_indices"]
        assert top[0] == sample.label, answers[rid]


class _Collector(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def otlp_collector() -> Iterator[tuple[str, list[bytes]]]:
    _Collector.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", _Collector.received
    finally:
        server.shutdown()


async def test_spans_are_exported_over_otlp(
    broker: Broker, names: dict[str, str], otlp_collector: tuple[str, list[bytes]]
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    endpoint, received = otlp_collector
    from worker.ops.samples import encode_samples, labelled_samples

    (key, value), (key2, value2) = encode_samples(labelled_samples(1)[:2])
    env = {"INFER_WORKER_TRACING__ENABLED": "true", "INFER_WORKER_TRACING__ENDPOINT": endpoint}
    w = await run_worker(broker, names, env)
    try:
        traced = [(key or b"", value, TRACE), (key2 or b"", value2, [])]
        await produce_with_headers(broker, names["requests"], traced)
        results, _ = await collect(broker, names, 2)
    finally:
        assert w.terminate() == 0, w.log_tail()  # shutdown exports what is buffered
    spans = []
    for body in received:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(spans) == 2, f"{len(spans)} spans exported"
    trace_id = PARENT.split("-")[1]
    span = next(s for s in spans if s.trace_id.hex() == trace_id)
    assert span.parent_span_id.hex() == PARENT.split("-")[2]
    assert {e.name for e in span.events} >= {"queue", "preprocess", "infer", "produce"}
    attributes = {a.key for a in span.attributes}
    assert {"infer.batch_size", "messaging.kafka.message.offset"} <= attributes
    # The result carries the exported span as its parent for whoever reads on.
    parents = [r.headers["traceparent"].decode().split("-") for r in results]
    assert [p[2] for p in parents if p[1] == trace_id] == [span.span_id.hex()]
    untraced = next(s for s in spans if s is not span)
    assert untraced.parent_span_id == b""  # a request without context starts a trace


README_KCAT = (
    """echo '{"id":"kcat-1","inputs":[{"name":"text","shape":[1],"datatype":"BYTES","""
    """"data":["The battery was great, i love it"]}]}' \\\n"""
    "  | kcat -P -b BOOTSTRAP -t REQUESTS -H content-type=application/json\n"
    "kcat -C -b BOOTSTRAP -t RESULTS -o beginning -c 1 -e -q"
)




async def test_the_readme_kcat_one_liner_gets_an_answer(
    broker: Broker, names: dict[str, str]
) -> None:
    """On Apache Kafka: Debian's kcat (librdkafka 1.9) cannot talk to the embedded
    broker at all (its ApiVersion request fails), as the README says."""
    if broker.kind != "kafka":
        pytest.skip("kcat's librdkafka 1.9 fails ApiVersionRequest against Tansu")
    binary("kcat", "apt-get install kcat (Debian/Ubuntu)")
    readme = await asyncio.to_thread(documentation)
    shown = {"BOOTSTRAP": "localhost:9092", "REQUESTS": "infer.requests",
             "RESULTS": "infer.results"}  # fmt: skip
    here = {"BOOTSTRAP": broker.bootstrap, "REQUESTS": names["requests"],
            "RESULTS": names["results"]}  # fmt: skip
    script = shown_script = README_KCAT
    for placeholder, value in shown.items():
        shown_script = shown_script.replace(placeholder, value)
        script = script.replace(placeholder, here[placeholder])
    assert shown_script in readme
    w = await run_worker(broker, names, {"INFER_WORKER_MODEL__PATH": "builtin:sentiment"})
    try:
        produce, consume = script.split("\nkcat -C")
        await asyncio.to_thread(subprocess.run, ["bash", "-c", produce], check=True, timeout=60)
        results, _ = await collect(broker, names, 1)
        proc = await asyncio.to_thread(subprocess.run, ["bash", "-c", "kcat -C" + consume],
                                       capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        assert w.terminate() == 0, w.log_tail()
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["id"] == "kcat-1" and answer["parameters"]["status"] == "ok"
    logits = {o["name"]: o["data"] for o in answer["outputs"]}["logits"]
    assert logits[1] > logits[0]  # positive
    assert json.loads(results[0].value)["id"] == "kcat-1"


async def test_the_client_and_produce_speak_it(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    """``InferenceClient(wire="oip")`` with several inputs by name, and ``infer-worker
    produce --oip``: JSON out, JSON back, read as results like msgpack ones."""
    import os
    import sys

    from worker.client import InferenceClient

    path = ranker(tmp_path / "ranker.onnx")
    features, ids = np.array([1, 2, 3, 4], np.float32), np.array([9, 8], np.int64)
    alone = run_alone(path, {"features": features, "ids": ids})
    w = await run_worker(broker, names, {"INFER_WORKER_MODEL__PATH": str(path)})
    try:
        client = InferenceClient(
            broker.bootstrap, input_topic=names["requests"], output_topic=names["results"],
            wire="oip",
        )  # fmt: skip
        async with client:
            result = await client.infer(inputs={"features": features, "ids": ids}, timeout=30)
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
        env.update({"INFER_WORKER_KAFKA__INPUT_TOPICS": names["requests"],
                    "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
                    "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"]})  # fmt: skip
        np.save(tmp_path / "features.npy", features)
        np.save(tmp_path / "ids.npy", ids)
        produce = [sys.executable, "-m", "worker", "produce", "--bootstrap-servers",
                   broker.bootstrap, "--oip", "--json", "--timeout", "60"]  # fmt: skip
        one = [str(tmp_path / "features.npy"), "--input", "features"]
        both = [f"--input=features={tmp_path / 'features.npy'}",
                f"--input=ids={tmp_path / 'ids.npy'}"]  # fmt: skip
        proc, whole = [await asyncio.to_thread(subprocess.run, produce + given, env=env,
                                               capture_output=True, text=True, timeout=120)
                       for given in (one, both)]  # fmt: skip
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert result.status == "ok", result.error
    np.testing.assert_allclose(result.outputs["score"].to_numpy(), alone["score"], rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    assert result.outputs["token_scores"].shape == (2,)
    # produce --oip sent one input of two: answered, as JSON, with the error naming
    # it, and an answer that is an error exits 1.
    assert proc.returncode == 1, proc.stderr
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert line["status"] == "error" and "inputs.ids: missing" in line["error"]["message"]
    # Both inputs (--input NAME=FILE, repeated): answered as the model alone.
    assert whole.returncode == 0, whole.stderr
    (line,) = [json.loads(x) for x in whole.stdout.splitlines() if x.startswith("{")]
    np.testing.assert_allclose(line["outputs"]["score"], alone["score"], rtol=1e-5, atol=1e-6)
