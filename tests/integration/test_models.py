"""Several models in one worker process (``[models.NAME]``): a two-input tensor
model as [model], a scikit-learn table of four inputs and the bundled text model
beside it, each on topics of its own, and routed by the request's ``model`` field
on [model]'s topic (msgpack and OIP JSON). Every answer equals its model run on
that request alone and names the model that gave it; a request that fits another
model's inputs but not its topic's model is that model's typed error; a request
naming a model or version the worker does not serve is answered
``unknown_model``; each model's latency and results are its own series in
/metrics."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.onnx_models import ranker, run_alone, sklearn_pipeline
from tests.serving import wire
from worker.contract import ModelRef, Request, Tensor
from worker.contract.oip_client import encode_oip_request
from worker.model.files import content_version
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.samples import sentiment_samples
from worker.ops.topics import Collector, committed_offsets, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")


async def test_three_models_in_one_worker_routed_by_topic(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("skl2onnx")
    rank_path = ranker(tmp_path / "ranker.onnx")
    churn_path, pipeline = sklearn_pipeline(tmp_path / "churn.onnx")
    topic = {m: f"{names['requests']}.{m}" for m in ("ranker", "churn", "sentiment")}
    await create_topics(broker.bootstrap, {**{t: 2 for t in topic.values()},
                                           names["results"]: 1, names["dlq"]: 1})  # fmt: skip
    rng = np.random.default_rng(11)
    ranked = {
        f"r-{i}": {
            "features": rng.normal(size=4).astype(np.float32),
            "ids": rng.integers(1, 50, int(rng.integers(1, 17))).astype(np.int64),
        }
        for i in range(60)
    }
    rows = np.stack([rng.normal(40, 12, 60), rng.normal(50, 20, 60), rng.exponential(3, 60),
                     rng.integers(0, 4, 60)], axis=1)  # fmt: skip
    texts = sentiment_samples()[:60]
    sent: dict[str, list[tuple[bytes, bytes]]] = {
        topic["ranker"]: [
            (rid.encode(), wire(rid, {k: Tensor.from_numpy(v) for k, v in feeds.items()}))
            for rid, feeds in ranked.items()
        ],
        topic["churn"]: [(f"c-{i}".encode(), wire(f"c-{i}", _churn_inputs(row)))
                         for i, row in enumerate(rows)],
        topic["sentiment"]: [(f"t-{i}".encode(), wire(f"t-{i}", {"text": s.text}))
                             for i, s in enumerate(texts)],
    }
    # A ranker's request on the text model's topic: answered by the text model,
    # which names the input it does not take.
    stray = ("stray", wire("stray", {k: Tensor.from_numpy(v) for k, v in ranked["r-0"].items()}))
    sent[topic["sentiment"]].append((b"stray", stray[1]))
    # On [model]'s topic, requests naming the other two (msgpack and OIP JSON), one
    # pinned to the serving version, and requests naming what the worker does not serve.
    churn_version = content_version(churn_path)
    named = [(f"n-{i}", wire(f"n-{i}", _churn_inputs(row), ModelRef("churn")))
             for i, row in enumerate(rows[:10])]  # fmt: skip
    named.append(("pinned", wire("pinned", _churn_inputs(rows[0]),
                                 ModelRef("churn", churn_version))))  # fmt: skip
    named += [
        ("unknown", wire("unknown", {"text": texts[0].text}, ModelRef("translator"))),
        ("old", wire("old", _churn_inputs(rows[0]), ModelRef("churn", "sha256:0ld"))),
        ("ranker", wire("ranker", {k: Tensor.from_numpy(v) for k, v in ranked["r-1"].items()},
                        ModelRef("ranker"))),
    ]  # fmt: skip
    sent[topic["ranker"]] += [(rid.encode(), value) for rid, value in named]
    as_json = [(f"j-{i}".encode(), encode_oip_request(Request(
        v=1, id=f"j-{i}", inputs={"text": s.text}, model=ModelRef("sentiment"))))
        for i, s in enumerate(texts[:10])]  # fmt: skip
    # On the text model's own topic, a request naming another served model.
    sent[topic["sentiment"]].append(
        (b"elsewhere", wire("elsewhere", _churn_inputs(rows[0]), ModelRef("churn")))
    )
    env = {
        "INFER_WORKER_MODEL__PATH": str(rank_path),
        "INFER_WORKER_MODEL__INPUTS__IDS__MAX_LENGTH": "16",
        "INFER_WORKER_MODELS__CHURN__PATH": str(churn_path),
        "INFER_WORKER_MODELS__CHURN__TOPICS": topic["churn"],
        "INFER_WORKER_MODELS__SENTIMENT__PATH": "builtin:sentiment",
        "INFER_WORKER_MODELS__SENTIMENT__TOPICS": topic["sentiment"],
    }
    w = spawn_worker(broker.bootstrap, input_topics=list(topic.values()),
                     output_topic=names["results"], dlq_topic=names["dlq"],
                     group_id=names["group"], extra_env=env)  # fmt: skip
    total = sum(len(v) for v in sent.values()) + len(as_json)
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 6, 90.0,
            "the assignment of the three models' six partitions",
        )  # fmt: skip
        for t, records in sent.items():
            await produce_all(broker.bootstrap, t, records)
        await produce_all(broker.bootstrap, topic["ranker"], as_json,
                          headers=[("content-type", b"application/json")])  # fmt: skip
        c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
        await c.start()
        try:
            done = await c.collect(lambda c: c.count() >= total, 90.0)
            assert done, f"{c.count()} of {total} answered\n{w.log_tail()}"
        finally:
            await c.stop()
        exposition = _metrics_text(w.metrics_port)
        listed = json.loads(_get(w.metrics_port, "/v2/models")[1])
        churn_card = json.loads(_get(w.metrics_port, "/v2/models/churn")[1])
        probes = {path: _get(w.metrics_port, path)[0] for path in (
            "/v2/models/churn/ready", f"/v2/models/churn/versions/{churn_version}/ready",
            "/v2/models/churn/versions/sha256:0ld/ready", "/v2/models/translator/ready",
            "/v2/health/ready")}  # fmt: skip
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert not c.records.get(names["dlq"]), "a readable request went to the DLQ"
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    assert len(results) == total

    for rid, feeds in ranked.items():
        r = results[rid]
        assert (r.status, r.model.name) == ("ok", "ranker"), r.error
        alone = run_alone(rank_path, feeds)
        np.testing.assert_allclose(r.outputs["score"].to_numpy(), alone["score"],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        np.testing.assert_array_equal(r.outputs["token_scores"].to_numpy(), alone["token_scores"])
    expected = pipeline.predict_proba(rows.astype(np.float32).astype(np.float64))
    for i in range(len(rows)):
        r = results[f"c-{i}"]
        assert (r.status, r.model.name) == ("ok", "churn"), r.error
        np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(), expected[i], atol=1e-5)
    correct = 0
    for i, s in enumerate(texts):
        r = results[f"t-{i}"]
        assert (r.status, r.model.name) == ("ok", "sentiment"), r.error
        assert r.outputs["token_scores"].shape == (s.tokens,)
        correct += int(r.outputs["logits"].to_numpy().argmax() == s.label)
    assert correct >= 0.9 * len(texts)
    stray_result = results["stray"]
    assert stray_result.model.name == "sentiment" and stray_result.error is not None
    assert stray_result.error.code == "invalid_request"
    assert stray_result.error.message == "inputs.features: unknown input; the model takes text"

    for i in range(10):  # routed by the request's model field, on [model]'s topic
        r = results[f"n-{i}"]
        assert (r.status, r.model.name, r.source.topic) == ("ok", "churn", topic["ranker"])
        np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(), expected[i], atol=1e-5)
        j, alone = results[f"j-{i}"], results[f"t-{i}"]
        assert (j.status, j.model.name) == ("ok", "sentiment"), j.error
        np.testing.assert_allclose(j.outputs["logits"].to_numpy(),
                                   alone.outputs["logits"].to_numpy(), rtol=1e-5)  # fmt: skip
    pinned = results["pinned"]
    assert (pinned.status, pinned.model.name, pinned.model.version) == (
        "ok", "churn", churn_version)  # fmt: skip
    named_ranker = results["ranker"]
    assert (named_ranker.status, named_ranker.model.name) == ("ok", "ranker")
    np.testing.assert_allclose(named_ranker.outputs["score"].to_numpy(),
                               run_alone(rank_path, ranked["r-1"])["score"], rtol=1e-5)  # fmt: skip
    unknown, old, elsewhere = results["unknown"], results["old"], results["elsewhere"]
    assert unknown.error is not None and unknown.error.code == "unknown_model"
    assert unknown.error.message == (
        "model: 'translator' is not served here; this worker serves 'ranker', 'churn', "
        "'sentiment'"
    )
    assert old.error is not None and old.error.code == "unknown_model", old.error
    assert old.model.name == "churn" and churn_version in old.error.message
    assert elsewhere.error is not None and elsewhere.error.code == "invalid_request"
    assert "carries 'sentiment'" in elsewhere.error.message, elsewhere.error

    # Each model on the metrics port as OIP servers show them, ready with the worker.
    assert [(m["name"], m["state"]) for m in listed["models"]] == [
        ("ranker", "READY"), ("churn", "READY"), ("sentiment", "READY")]  # fmt: skip
    assert churn_card["versions"] == [churn_version] and churn_card["platform"] == "onnxruntime"
    assert {i["name"]: (i["datatype"], i["shape"]) for i in churn_card["inputs"]} == {
        "age": ("FP32", [-1, 1]), "income": ("FP32", [-1, 1]), "tenure": ("FP32", [-1, 1]),
        "plan": ("INT64", [-1, 1])}  # fmt: skip
    assert list(probes.values()) == [200, 200, 404, 404, 200], probes
    for t, records in sent.items():
        committed = await committed_offsets(broker.bootstrap, names["group"], t, 2)
        extra = len(as_json) if t == topic["ranker"] else 0
        assert sum(committed.values()) == len(records) + extra, (t, committed)
    # Each request counted under the model that answered it (a request naming no
    # served model: its topic's).
    for model, count in (("ranker", 62), ("churn", 72), ("sentiment", 72)):
        found = re.search(rf'infer_request_seconds_count\{{[^}}]*model="{model}"[^}}]*\}} (\S+)',
                          exposition)  # fmt: skip
        assert found and float(found.group(1)) == count, (model, found)
        assert re.search(rf'infer_build_info\{{[^}}]*model="{model}"', exposition), model


def _churn_inputs(row: np.ndarray) -> dict[str, Tensor]:
    return {
        "age": Tensor.from_numpy(np.array([row[0]], np.float32)),
        "income": Tensor.from_numpy(np.array([row[1]], np.float32)),
        "tenure": Tensor.from_numpy(np.array([row[2]], np.float32)),
        "plan": Tensor.from_numpy(np.array([int(row[3])], np.int64)),
    }


def _metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
