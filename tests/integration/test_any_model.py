"""Models of any inputs, served from Kafka by a real worker process: a two-input
model with a free sequence dimension and a per-token output, a scikit-learn
table of four inputs, the bundled text model. Every answer equals the model run
on that request alone; every bad request is an error result naming its input
(never a DLQ record: the envelope decoded); offsets are committed for all."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.onnx_models import ranker, run_alone, sklearn_pipeline
from tests.serving import serve, wire
from worker.contract import EncodedImage, Tensor
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.processes import spawn_worker

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")


async def test_a_two_input_model_with_a_per_token_output(
    broker: EmbeddedBroker, names: dict[str, str], tmp_path: Path
) -> None:
    path = ranker(tmp_path / "ranker.onnx")
    rng = np.random.default_rng(7)
    good: dict[str, dict[str, np.ndarray]] = {}
    for i in range(120):
        good[f"ok-{i}"] = {
            "features": rng.normal(size=4).astype(np.float32),
            "ids": rng.integers(1, 50, int(rng.integers(1, 33))).astype(np.int64),
        }
    f4, ids = np.ones(4, np.float32), np.ones(3, np.int64)
    bad: dict[str, tuple[dict[str, Any], str, str]] = {
        "missing": ({"features": f4}, "invalid_request", "inputs.ids: missing"),
        "unknown": (
            {"features": f4, "ids": ids, "extra": f4},
            "invalid_request",
            "inputs.extra: unknown input",
        ),
        "dtype": (
            {"features": f4.astype(np.float64), "ids": ids},
            "invalid_request",
            "inputs.features.dtype: expected float32, got float64",
        ),
        "fixed-dim": (
            {"features": np.ones(3, np.float32), "ids": ids},
            "invalid_request",
            "inputs.features.shape[0]: expected 4",
        ),
        "too-long": (
            {"features": f4, "ids": np.ones(33, np.int64)},
            "too_large",
            "inputs.ids.shape[0]: 33 exceeds the limit 32",
        ),
        "text": ({"features": f4, "ids": "1 2 3"}, "invalid_request", "got a string"),
        "image": (
            {"features": f4, "ids": EncodedImage("png", b"\x89PNG\r\n\x1a\n...")},
            "invalid_request",
            "inputs.ids: expected a tensor int64 [sequence] (a map of dtype, shape, data), "
            "got an image file (png, msgpack bin)",
        ),
    }
    requests = [
        (rid, wire(rid, {k: Tensor.from_numpy(v) for k, v in feeds.items()}))
        for rid, feeds in good.items()
    ]
    for rid, (given, _, _) in bad.items():
        values = {
            k: v if isinstance(v, str | EncodedImage) else Tensor.from_numpy(v)
            for k, v in given.items()
        }
        requests.append((rid, _raw_wire(rid, values)))
    results = await serve(
        broker,
        names,
        requests,
        {
            "INFER_WORKER_MODEL__PATH": str(path),
            "INFER_WORKER_MODEL__INPUTS__IDS__MAX_LENGTH": "32",
        },
    )
    for rid, feeds in good.items():
        r = results[rid]
        assert r.status == "ok", r.error
        alone = run_alone(path, feeds)
        # Equal up to float rounding: a sum over padded zeros may add in another order.
        np.testing.assert_allclose(
            r.outputs["score"].to_numpy(), alone["score"], rtol=1e-5, atol=1e-6
        )
        # At the request's own length, equal to the model run on it alone.
        np.testing.assert_array_equal(r.outputs["token_scores"].to_numpy(), alone["token_scores"])
        assert r.model.name == "ranker"
    for rid, (_, code, message) in bad.items():
        r = results[rid]
        assert r.status == "error" and r.error is not None, rid
        assert (r.error.code, message in r.error.message) == (code, True), r.error


def _raw_wire(rid: str, inputs: Mapping[str, Any]) -> bytes:
    """A request as a client writes it, whatever the inputs hold (a bin that is not
    an image file included, which ``EncodedImage`` would not carry)."""
    from worker.contract.wire import pack

    def one(v: Any) -> Any:
        if isinstance(v, EncodedImage):
            return v.data
        return v if isinstance(v, str) else v.to_wire()

    return pack({"v": 1, "id": rid, "inputs": {k: one(v) for k, v in inputs.items()}})


async def test_a_scikit_learn_table_of_four_inputs(
    broker: EmbeddedBroker, names: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("skl2onnx")
    path, pipeline = sklearn_pipeline(tmp_path / "churn.onnx")
    rng = np.random.default_rng(3)
    rows = np.stack(
        [rng.normal(40, 12, 60), rng.normal(50, 20, 60), rng.exponential(3, 60),
         rng.integers(0, 4, 60)], axis=1,
    )  # fmt: skip
    requests = []
    for i, row in enumerate(rows):
        inputs = {
            "age": Tensor.from_numpy(np.array([row[0]], np.float32)),
            "income": Tensor.from_numpy(np.array([row[1]], np.float32)),
            "tenure": Tensor.from_numpy(np.array([row[2]], np.float32)),
            "plan": Tensor.from_numpy(np.array([int(row[3])], np.int64)),
        }
        requests.append((f"row-{i}", wire(f"row-{i}", inputs)))
    results = await serve(broker, names, requests, {"INFER_WORKER_MODEL__PATH": str(path)})
    expected = pipeline.predict_proba(rows.astype(np.float32).astype(np.float64))
    for i in range(len(rows)):
        r = results[f"row-{i}"]
        assert r.status == "ok", r.error
        assert set(r.outputs) == {"label", "probabilities"}
        assert r.outputs["label"].shape == ()  # a scalar per row
        np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(), expected[i], atol=1e-5)
        assert int(r.outputs["label"].to_numpy()) == int(expected[i].argmax())


async def test_the_bundled_text_model(broker: EmbeddedBroker, names: dict[str, str]) -> None:
    from worker.ops.samples import sentiment_samples

    samples = sentiment_samples()[:80]
    requests = [(f"t-{i}", wire(f"t-{i}", {"text": s.text})) for i, s in enumerate(samples)]
    requests += [
        ("empty", wire("empty", {"text": ""})),
        ("tensor", wire("tensor", {"text": Tensor.from_numpy(np.ones(3, np.int64))})),
    ]
    env = {"INFER_WORKER_MODEL__PATH": "builtin:sentiment"}
    results = await serve(broker, names, requests, env)
    correct = 0
    for i, s in enumerate(samples):
        r = results[f"t-{i}"]
        assert r.status == "ok", r.error
        assert r.model.name == "sentiment"
        scores = r.outputs["token_scores"].to_numpy()
        assert scores.shape == (s.tokens,)  # this text's own token count
        correct += int(r.outputs["logits"].to_numpy().argmax() == s.label)
    assert correct >= 0.9 * len(samples)
    assert results["empty"].error is not None
    assert results["empty"].error.message == "inputs.text: the text is empty"
    assert results["tensor"].error is not None
    assert "expected a text (a UTF-8 string), got a tensor" in results["tensor"].error.message


async def test_produce_sends_texts_and_samples_of_the_text_model(
    broker: EmbeddedBroker, names: dict[str, str]
) -> None:
    """``infer-worker produce --text`` and ``--samples N --model sentiment`` against a
    worker serving the bundled text model: every request answered, exit 0."""
    import os
    import subprocess
    import sys

    await create_topics(broker.bootstrap, {names["requests"]: 1, names["results"]: 1,
                                           names["dlq"]: 1})  # fmt: skip
    w = spawn_worker(
        broker.bootstrap, input_topics=[names["requests"]], output_topic=names["results"],
        dlq_topic=names["dlq"], group_id=names["group"],
        extra_env={"INFER_WORKER_MODEL__PATH": "builtin:sentiment"},
    )  # fmt: skip
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 1, 60.0, "assignment"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
        env.update({
            "INFER_WORKER_KAFKA__INPUT_TOPICS": names["requests"],
            "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
            "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"],
        })  # fmt: skip
        argv = [sys.executable, "-m", "worker", "produce", "--bootstrap-servers", broker.bootstrap,
                "--text", "The screen was brilliant, i love it", "--samples", "2",
                "--model", "sentiment", "--json", "--timeout", "60"]  # fmt: skip
        proc = await asyncio.to_thread(
            subprocess.run, argv, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert proc.returncode == 0, proc.stderr
    import json

    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 3 and all(r["status"] == "ok" for r in lines), proc.stdout
    text = next(r for r in lines if r["id"].startswith("text-"))
    assert int(np.argmax(text["outputs"]["logits"])) == 1  # positive


async def test_produce_sends_several_named_inputs_and_fails_on_an_error_answer(
    broker: EmbeddedBroker, names: dict[str, str], tmp_path: Path
) -> None:
    """``produce --input NAME=FILE`` (repeated) sends one request of several inputs,
    answered as the model alone; an answer that is an error exits 1 (it exited 0),
    unless ``--allow-errors``."""
    import json
    import os
    import subprocess
    import sys

    path = ranker(tmp_path / "ranker.onnx")
    feeds = {"features": np.arange(4, dtype=np.float32), "ids": np.array([3, 1, 4], np.int64)}
    for name, value in feeds.items():
        np.save(tmp_path / f"{name}.npy", value)
    np.save(tmp_path / "wrong.npy", np.zeros(3, np.float64))  # not the model's dtype
    await create_topics(broker.bootstrap, {names["requests"]: 1, names["results"]: 1,
                                           names["dlq"]: 1})  # fmt: skip
    w = spawn_worker(
        broker.bootstrap, input_topics=[names["requests"]], output_topic=names["results"],
        dlq_topic=names["dlq"], group_id=names["group"],
        extra_env={"INFER_WORKER_MODEL__PATH": str(path)},
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    env.update({"INFER_WORKER_KAFKA__INPUT_TOPICS": names["requests"],
                "INFER_WORKER_KAFKA__OUTPUT_TOPIC": names["results"],
                "INFER_WORKER_KAFKA__DLQ_TOPIC": names["dlq"]})  # fmt: skip

    def produce(*given: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "worker", "produce", "--bootstrap-servers",
                broker.bootstrap, "--json", "--timeout", "60", *given]  # fmt: skip
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip

    ids = f"--input=ids={tmp_path / 'ids.npy'}"
    named = [f"--input=features={tmp_path / 'features.npy'}", ids]
    wrong = [f"--input=features={tmp_path / 'wrong.npy'}", ids]
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 1, 60.0, "assignment"
        )
        ok = await asyncio.to_thread(produce, *named)
        failed = await asyncio.to_thread(produce, *wrong)
        allowed = await asyncio.to_thread(produce, *wrong, "--allow-errors")
    finally:
        assert w.terminate() == 0, w.log_tail()
    assert ok.returncode == 0, ok.stderr
    (answer,) = [json.loads(line) for line in ok.stdout.splitlines() if line.startswith("{")]
    alone = run_alone(path, feeds)
    np.testing.assert_allclose(answer["outputs"]["score"], alone["score"], rtol=1e-5)
    assert failed.returncode == 1 and "1 of 1 answered with an error" in failed.stderr
    assert '"status": "error"' in failed.stdout and "invalid_request" in failed.stdout
    assert allowed.returncode == 0, allowed.stderr
