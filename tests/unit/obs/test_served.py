"""The OIP model endpoints of the metrics port (``worker.obs.served``): a model's
card from its file, readiness following the worker's, 404s naming what is served."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from worker.app.cards import model_card, publish
from worker.compute.engines import load_engine
from worker.config import ModelConfig
from worker.obs import metrics, served


@pytest.fixture
def digits() -> Iterator[str]:
    engine = load_engine(ModelConfig())
    publish(engine.info)
    try:
        yield engine.info.version
    finally:
        engine.close()
        served.withdraw_all()
        metrics.set_condition("started", False)


def test_a_card_is_the_model_file_s_declaration() -> None:
    engine = load_engine(ModelConfig(name="sentiment", path="builtin:sentiment"))
    try:
        card = model_card(engine.info)
    finally:
        engine.close()
    assert (card["name"], card["platform"], card["versions"]) == (
        "sentiment", "onnxruntime", [engine.info.version])  # fmt: skip
    assert {t["name"]: t["datatype"] for t in card["inputs"]} == {
        "input_ids": "INT64", "attention_mask": "INT64"}  # fmt: skip
    assert all(t["shape"][0] == -1 for t in card["inputs"])  # the batch, free


def test_readiness_follows_the_worker_s(digits: str) -> None:
    metrics.set_condition("started", False)
    assert served.answer("/v2/models/digits/ready")[0] == 503
    assert served.answer("/v2/health/ready")[0] == 503
    listed = json.loads(served.answer("/v2/models")[1])
    assert listed == {"models": [{"name": "digits", "version": digits, "state": "UNAVAILABLE"}]}
    metrics.set_condition("started", True)
    assert served.answer("/v2/models/digits/ready")[0] == 200
    assert served.answer(f"/v2/models/digits/versions/{digits}/ready")[0] == 200
    code, body = served.answer(f"/v2/models/digits/versions/{digits}")
    assert code == 200 and json.loads(body)["versions"] == [digits]


def test_what_is_not_served_is_404_naming_what_is(digits: str) -> None:
    code, body = served.answer("/v2/models/mnist/ready")
    assert code == 404
    assert json.loads(body) == {"error": "model 'mnist' is not served here; this worker "
                                         "serves 'digits'"}  # fmt: skip
    code, body = served.answer("/v2/models/digits/versions/7/ready")
    assert code == 404 and f"it serves {digits!r}" in json.loads(body)["error"]
    assert served.answer("/v2/models/digits/infer")[0] == 404
    assert served.answer("/v2/repository")[0] == 404
    code, body = served.answer("/v2")
    assert code == 200 and json.loads(body)["name"] == "infer-worker"
