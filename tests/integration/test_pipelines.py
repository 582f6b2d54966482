"""Pipelines of real models in one worker (issue 59). First, openWakeWord's
melspectrogram model, a function between (the spectrogram scaled as
openWakeWord scales it, its last 76 frames), and openWakeWord's embedding model,
declared as ``[pipelines.wakeword]``. Requests of several audio lengths share
batches; every answer equals the same files run one after another by hand on
that request alone (onnxruntime, the function in numpy), carries the
intermediate the pipeline names, and a request a step fails is answered naming
the step; the first step's outputs also go to a topic of its own, one record
per request answered. Then PaddleOCR's detector and recogniser with the
built-in crop step between them: every text line a page holds recognised, as
the files run by hand. On both brokers."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import real_models
from tests.pipeline_functions import mel_window
from tests.serving import wire
from tests.wakeword import EMBEDDING, wakeword_toml
from worker.contract import ModelRef, Tensor
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration

WITH_MEL = f'{EMBEDDING}, mel = "mel.output"'  # the intermediate too

def _card(port: int, name: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{name}", timeout=5) as resp:
        card: dict[str, Any] = json.loads(resp.read())
    return card


def by_hand(audio: np.ndarray) -> dict[str, np.ndarray]:
    """The two model files and the function, one after another, on one request."""
    mel_session = real_models._session(str(real_models.model_path("oww-melspectrogram")))
    embed_session = real_models._session(str(real_models.model_path("oww-embedding")))
    mel = mel_session.run(None, {"input": audio[None]})[0][0]
    frames = mel_window(mel)["frames"]
    embedding = embed_session.run(None, {"input_1": frames[None]})[0][0]
    return {"mel": mel, "embedding": embedding}


async def test_a_pipeline_of_two_models_and_a_function_answers_as_by_hand(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topic, mel_topic = names["requests"], f"{names['requests']}.mel"
    config = tmp_path / "worker.toml"
    config.write_text(wakeword_toml(topic, outputs=WITH_MEL, mel_topic=mel_topic))
    await create_topics(broker.bootstrap, {topic: 2, names["results"]: 1, names["dlq"]: 1,
                                           mel_topic: 2})  # fmt: skip
    rng = np.random.default_rng(59)
    audio = {f"a-{i}": rng.normal(0, 3000, n).astype(np.float32)
             for i, n in enumerate([13000, 16000, 20000] * 5)}  # fmt: skip
    requests = [(rid.encode(), wire(rid, {"input": Tensor.from_numpy(a)}))
                for rid, a in audio.items()]  # fmt: skip
    short = rng.normal(0, 3000, 8000).astype(np.float32)  # 47 mel frames: the window refuses
    requests.append((b"short", wire("short", {"input": Tensor.from_numpy(short)})))
    requests.append((b"ints", wire("ints", {"input": Tensor.from_numpy(short.astype(np.int64))})))
    clip = Tensor.from_numpy(audio["a-0"])
    requests.append((b"named", wire("named", {"input": clip}, ModelRef("wakeword"))))
    requests.append((b"old", wire("old", {"input": clip}, ModelRef("wakeword", "pipeline:0"))))
    w = spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=names["results"],
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(config)),
                     extra_env={"INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS": "100"})  # fmt: skip
    c = Collector(broker.bootstrap, [names["results"], names["dlq"], mel_topic])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0,
            "partition assignment",
        )  # fmt: skip
        await produce_all(broker.bootstrap, topic, requests)
        await c.start()
        answered = lambda c: len(c.records.get(names["results"], []))  # noqa: E731
        audits = lambda c: len(c.records.get(mel_topic, []))  # noqa: E731
        # The mel step's records are written beside the answers, not before them:
        # wait for both (stopping at the answers alone once read none of them).
        assert await c.collect(
            lambda c: answered(c) >= len(requests) and audits(c) >= len(audio) + 1, 90.0
        ), f"{answered(c)} of {len(requests)}, {audits(c)} mel records\n{w.log_tail()}"
        await c.collect(lambda c: False, 1.0)  # and nothing more (each written once)
        m = w.metrics()
        card = _card(w.metrics_port, "wakeword")
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
        await c.stop()
    assert not c.records.get(names["dlq"])
    # The pipeline on the metrics port as OIP servers show a model: the first model's
    # request, the pipeline's outputs as its steps declare them.
    assert (card["platform"], card["inputs"][0]["name"]) == ("pipeline", "input")
    outputs = {o["name"]: o for o in card["outputs"]}
    assert outputs["embedding"]["datatype"] == "FP32" and len(outputs["embedding"]["shape"]) == 4
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    for rid, samples in audio.items():
        r = results[rid]
        assert (r.status, r.model.name) == ("ok", "wakeword"), r.error
        assert r.model.version.startswith("pipeline:")
        want = by_hand(samples)
        assert set(r.outputs) == {"embedding", "mel"}
        for name, value in want.items():
            np.testing.assert_allclose(r.outputs[name].to_numpy(), value, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{rid} {name}")  # fmt: skip
    failed, invalid = results["short"], results["ints"]
    assert failed.error is not None and failed.error.code == "inference_failed"
    assert failed.error.message == (
        "step 'window': ValueError: 47 mel frames; the embedding takes 76"
    ), failed.error
    assert invalid.error is not None and invalid.error.code == "invalid_request"
    assert "inputs.input" in invalid.error.message
    named, old = results["named"], results["old"]
    assert named.status == "ok", named.error  # a request may name the pipeline, as a model
    np.testing.assert_allclose(named.outputs["embedding"].to_numpy(),
                               results["a-0"].outputs["embedding"].to_numpy())  # fmt: skip
    assert old.error is not None and old.error.code == "unknown_model"
    assert old.error.message.startswith("model.version: 'pipeline:0' is not served; 'wakeword'")
    # The mel step's outputs on its own topic, one record per request answered ok.
    audited = {r.result().id: r.result() for r in c.records[mel_topic]}
    assert set(audited) == {*audio, "named"} and len(c.records[mel_topic]) == len(audited)
    for rid, samples in audio.items():
        mel = audited[rid]
        assert (mel.model.name, mel.source.topic) == ("wakeword/mel", topic)
        np.testing.assert_allclose(mel.outputs["output"].to_numpy(), by_hand(samples)["mel"],
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    failures = {k.partition("step=")[2].strip('"}'): v for k, v in m.items()
                if k.startswith("infer_pipeline_step_failures_total")}  # fmt: skip
    assert failures == {"mel": 0.0, "window": 1.0, "embed": 0.0}, failures
    steps = {k for k in m if k.startswith("infer_pipeline_step_seconds_count")}
    assert len(steps) == 3, steps


OCR = """
[model]
name = "det"
path = "{det}"
[models.rec]
path = "{rec}"
[pipelines.ocr]
topics = ["{topic}"]
outputs = {{ boxes = "boxes.boxes", ids = "text.ids" }}
[[pipelines.ocr.steps]]
name = "det"
model = "det"
[[pipelines.ocr.steps]]
name = "boxes"
function = "tests.pipeline_functions:text_boxes"
inputs = {{ prob = "det.sigmoid_0.tmp_0" }}
outputs = {{ boxes = "float32 [boxes, 4]" }}
[[pipelines.ocr.steps]]
name = "pixels"
function = "tests.pipeline_functions:pixels"
inputs = {{ x = "request.x" }}
outputs = {{ image = "uint8 [H, W, 3]" }}
[[pipelines.ocr.steps]]
name = "crop"
op = "crop_boxes"
size = [48, 160]
inputs = {{ image = "pixels.image", boxes = "boxes.boxes" }}
[[pipelines.ocr.steps]]
name = "recin"
function = "tests.pipeline_functions:rec_input"
inputs = {{ crop = "crop.crops" }}
outputs = {{ x = "float32 [3, 48, 160]" }}
[[pipelines.ocr.steps]]
name = "rec"
model = "rec"
inputs = {{ x = "recin.x" }}
[[pipelines.ocr.steps]]
name = "text"
function = "tests.pipeline_functions:greedy"
inputs = {{ probs = "rec.softmax_11.tmp_0" }}
outputs = {{ ids = "int64 [steps]" }}
"""


def _page(words: list[tuple[int, int, str]], size: tuple[int, int]) -> np.ndarray:
    """A white page with black words, as the detector takes it: float32 [3, H, W]."""
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=24)
    for x, y, text in words:
        draw.text((x, y), text, fill="black", font=font)
    pixels = np.asarray(page, np.float32) / 255.0
    return np.ascontiguousarray(((pixels - 0.5) / 0.5).transpose(2, 0, 1))


def ocr_by_hand(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Detector, boxes, crops, recogniser, one after another on one page: the boxes,
    each crop's character probabilities and its greedy ids."""
    from tests.pipeline_functions import greedy, pixels, rec_input, text_boxes
    from worker.compute.ops.crops import crop_boxes

    det = real_models._session(str(real_models.model_path("ppocr-det")))
    rec = real_models._session(str(real_models.model_path("ppocr-rec")))
    boxes = text_boxes(det.run(None, {"x": x[None]})[0][0])["boxes"]
    crops = crop_boxes(pixels(x)["image"], boxes, (48, 160))["crops"]
    probs = [rec.run(None, {"x": rec_input(c)["x"][None]})[0][0] for c in crops]
    # A page without lines: no regions, the output's rank kept ([0, steps], steps free: 0).
    ids = np.stack([greedy(p)["ids"] for p in probs]) if probs else np.zeros((0, 0), np.int64)
    return boxes, np.stack(probs) if probs else np.zeros((0,)), ids


async def test_detect_crop_recognise_answers_as_the_files_by_hand(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    """PaddleOCR's detector and recogniser with the crop step between them: every
    text line found on a page is recognised, the crops of all pages as batches of
    the recogniser, every answer as the files run by hand (where the recogniser's
    top character is not a near tie between two)."""
    topic = names["requests"]
    config = tmp_path / "worker.toml"
    config.write_text(OCR.format(det=real_models.model_path("ppocr-det"),
                                 rec=real_models.model_path("ppocr-rec"), topic=topic))  # fmt: skip
    await create_topics(broker.bootstrap, {topic: 2, names["results"]: 1, names["dlq"]: 1})
    pages = {
        "two-lines": _page([(10, 10, "HELLO 123"), (40, 70, "kafka")], (320, 128)),
        "one-line": _page([(20, 20, "worker")], (256, 96)),
        "blank": _page([], (160, 64)),
        "three": _page([(5, 5, "one"), (5, 45, "two"), (5, 85, "three")], (192, 128)),
    }
    requests = [(pid.encode(), wire(pid, {"x": Tensor.from_numpy(x)})) for pid, x in pages.items()]
    w = spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=names["results"],
                     dlq_topic=names["dlq"], group_id=names["group"],
                     command=("run", "--config", str(config)),
                     extra_env={"INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS": "100"})  # fmt: skip
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0,
            "partition assignment",
        )  # fmt: skip
        await produce_all(broker.bootstrap, topic, requests)
        await c.start()
        assert await c.collect(lambda c: c.count() >= len(requests), 90.0), (
            f"{c.count()} of {len(requests)}\n{w.log_tail()}"
        )
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
        await c.stop()
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    lines = 0
    for pid, x in pages.items():
        r = results[pid]
        assert (r.status, r.model.name) == ("ok", "ocr"), r.error
        boxes, probs, ids = ocr_by_hand(x)
        np.testing.assert_array_equal(r.outputs["boxes"].to_numpy(), boxes, err_msg=pid)
        got = r.outputs["ids"].to_numpy()
        assert got.shape == ids.shape, (pid, got.shape, ids.shape)
        lines += len(boxes)
        if len(boxes):
            top2 = np.sort(probs, axis=-1)[..., -2:]
            clear = top2[..., 1] - top2[..., 0] > 1e-3  # a near tie may go either way
            np.testing.assert_array_equal(got[clear], ids[clear], err_msg=pid)
    assert lines >= 5, lines  # the detector found the pages' lines
