"""Pipelines whose request is their own (``[pipelines.NAME.inputs]``, issue 65):
a function before the first model (raw features standardised by a vectorized
function, a batch's rows at once, then a two-input
model reading the other input from the request), and crops of the request's
original pixels after a detector fed floats (a function scales the pixels, a
fully convolutional detector finds a peak, a function makes its box, crop_boxes
cuts it from the pixels as sent, the digits model reads the crop), and a detector
cascade of the built-in operations (resize to 32x32 for the detector, every map
position a candidate, nms keeps three, their boxes scaled back to the original
pixels, crops read by the digits model where a branch per crop says so, and a
per-crop output of varying length answered ragged), and a branch and an optional step (a
gate function decides whether the two-input model runs; an optional function
fails some requests; answers name what did not run in ``partial``). Served by one
worker of [models.NAME] sections alone, on both brokers; every answer equals the
steps run by hand on that request alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests import pipeline_functions as fn
from tests import read_pipeline
from tests.onnx_models import conv_detector, ranker, run_alone
from tests.serving import wire
from worker.compute.engines import load_engine
from worker.compute.ops.crops import crop_boxes
from worker.compute.ops.nms import nms
from worker.config import ModelConfig
from worker.contract import Tensor
from worker.model.inputs.image import resolve
from worker.model.preprocess import ImagePreprocess, preprocess
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")

CONFIG = """
[models.ranker]
path = "{ranker}"
[models.detector]
path = "{detector}"
[models.digits]
path = "builtin:digits"

[pipelines.scored]
topics = ["{scored}"]
inputs = {{ raw = "float32 [4]", ids = "int64 [n]" }}
outputs = {{ score = "rank.score", features = "norm.features" }}
[[pipelines.scored.steps]]
name = "norm"
function = "tests.pipeline_functions:standardise_rows"
vectorized = true
inputs = {{ raw = "request.raw" }}
outputs = {{ features = "float32 [4]" }}
[[pipelines.scored.steps]]
name = "rank"
model = "ranker"
inputs = {{ features = "norm.features", ids = "request.ids" }}

[pipelines.read]
topics = ["{read}"]
inputs = {{ pixels = "uint8 [H, W, 1]" }}
outputs = {{ digit = "digit.topk_indices", boxes = "peak.boxes" }}
{read_steps}
[pipelines.gated]
topics = ["{gated}"]
inputs = {{ raw = "float32 [4]", ids = "int64 [n]" }}
outputs = {{ score = "rank.score", go = "cheap.go", checked = "check.y" }}
[[pipelines.gated.steps]]
name = "cheap"
function = "tests.pipeline_functions:gate"
inputs = {{ raw = "request.raw" }}
outputs = {{ go = "uint8 [1]", features = "float32 [4]" }}
[[pipelines.gated.steps]]
name = "rank"
model = "ranker"
when = "cheap.go"
inputs = {{ features = "cheap.features", ids = "request.ids" }}
[[pipelines.gated.steps]]
name = "check"
function = "tests.pipeline_functions:fragile"
optional = true
inputs = {{ features = "cheap.features" }}
outputs = {{ y = "float32 [1]" }}

[pipelines.twice]
topics = ["{twice}"]
inputs = {{ pixels = "uint8 [H, W, 1]" }}
outputs = {{ digit = "digit.topk_indices", refined = "refine.box", first = "split.box" }}
[[pipelines.twice.steps]]
name = "scale"
function = "tests.pipeline_functions:as_floats"
inputs = {{ pixels = "request.pixels" }}
outputs = {{ x = "float32 [1, H, W]" }}
{twice_detect}[[pipelines.twice.steps]]
name = "split"
function = "tests.pipeline_functions:regions"
fan_out = true
inputs = {{ pixels = "request.pixels", boxes = "keep.boxes" }}
outputs = {{ crop = "uint8 [16, 16, 1]", box = "float32 [4]" }}
[[pipelines.twice.steps]]
name = "refine"
function = "tests.pipeline_functions:refine"
inputs = {{ crop = "split.crop", box = "split.box" }}
outputs = {{ box = "float32 [1, 4]" }}
[[pipelines.twice.steps]]
name = "crop"
op = "crop_boxes"
size = [8, 8]
inputs = {{ image = "request.pixels", boxes = "refine.box" }}
[[pipelines.twice.steps]]
name = "digit"
model = "digits"
inputs = {{ image = "crop.crops" }}

[pipelines.cascade]
topics = ["{cascade}"]
inputs = {{ pixels = "uint8 [H, W, 1]" }}
ragged = ["row"]
[pipelines.cascade.outputs]
digit = "digit.topk_indices"
kept = "keep.indices"
lit = "lit.go"
row = "strip.row"
[[pipelines.cascade.steps]]
name = "small"
op = "resize"
preprocess = {{ size = [32, 32], channels = 1, mean = [0.0], std = [1.0] }}
inputs = {{ image = "request.pixels" }}
{cascade_detect}[[pipelines.cascade.steps]]
name = "orig"
function = "tests.pipeline_functions:to_pixels"
inputs = {{ boxes = "keep.boxes", pixels = "request.pixels" }}
outputs = {{ boxes = "float32 [kept, 4]" }}
[[pipelines.cascade.steps]]
name = "crop"
op = "crop_boxes"
size = [8, 8]
inputs = {{ image = "request.pixels", boxes = "orig.boxes" }}
[[pipelines.cascade.steps]]
name = "lit"
function = "tests.pipeline_functions:bright"
inputs = {{ tile = "crop.crops" }}
outputs = {{ go = "bool [1]" }}
[[pipelines.cascade.steps]]
name = "digit"
model = "digits"
when = "lit.go"
inputs = {{ image = "crop.crops" }}
[[pipelines.cascade.steps]]
name = "strip"
function = "tests.pipeline_functions:strip"
inputs = {{ tile = "crop.crops" }}
outputs = {{ row = "uint8 [n]" }}
"""


def _detect_steps(pipeline: str, source: str, max_boxes: int) -> str:
    """The detector, every map position a candidate, nms: the steps both detector
    pipelines share (``source``: the detector's input, as each makes it)."""
    return f"""[[pipelines.{pipeline}.steps]]
name = "detect"
model = "detector"
inputs = {{ x = "{source}" }}
[[pipelines.{pipeline}.steps]]
name = "cands"
function = "tests.pipeline_functions:candidates"
inputs = {{ heat = "detect.heat" }}
outputs = {{ boxes = "float32 [n, 4]", scores = "float32 [n]" }}
[[pipelines.{pipeline}.steps]]
name = "keep"
op = "nms"
iou_threshold = 0.3
max_boxes = {max_boxes}
inputs = {{ boxes = "cands.boxes", scores = "cands.scores" }}
"""


def _kept_by_hand(det_path: Path, x: np.ndarray, max_boxes: int) -> dict[str, np.ndarray]:
    """The shared steps by hand: the detector on ``x``, candidates, nms."""
    heat = run_alone(det_path, {"x": x})["heat"]
    found = fn.candidates(heat)
    return nms(found["boxes"], found["scores"], 0.3, max_boxes=max_boxes)


def _digits_by_hand(crops: np.ndarray) -> np.ndarray:
    """The bundled digits model's top class of each crop, run directly."""
    cfg = ModelConfig()
    engine = load_engine(cfg)
    try:
        desc = engine.info.io.inputs[0]
        batch = preprocess(list(crops), resolve(cfg.preprocess, desc))
        logits = engine.run({desc.name: batch})[engine.info.output_names[0]]
    finally:
        engine.close()
    return np.asarray(logits).argmax(axis=1)


async def test_preprocessing_first_and_crops_of_the_request_s_pixels(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    rank_path, det_path = ranker(tmp_path / "ranker.onnx"), conv_detector(tmp_path / "det.onnx")
    topics = {p: f"{names['requests']}.{p}"
              for p in ("scored", "read", "cascade", "gated", "twice")}  # fmt: skip
    config = tmp_path / "worker.toml"
    config.write_text(CONFIG.format(read_steps=read_pipeline.STEPS,
        ranker=rank_path, detector=det_path, **topics,
        twice_detect=_detect_steps("twice", "scale.x", 2),
        cascade_detect=_detect_steps("cascade", "small.image", 3)))  # fmt: skip
    await create_topics(broker.bootstrap, {**{t: 2 for t in topics.values()},
                                           names["results"]: 1, names["dlq"]: 1})  # fmt: skip
    rng = np.random.default_rng(65)
    scored = {f"s-{i}": {"raw": rng.normal(1.5, 2.0, 4).astype(np.float32),
                         "ids": rng.integers(1, 50, int(rng.integers(1, 9))).astype(np.int64)}
              for i in range(24)}  # fmt: skip
    read = {f"r-{i}": rng.integers(0, 256, (int(rng.integers(16, 40)), int(rng.integers(16, 40)),
                                            1)).astype(np.uint8) for i in range(24)}  # fmt: skip
    w = spawn_worker(broker.bootstrap, input_topics=list(topics.values()),
                     output_topic=names["results"], dlq_topic=names["dlq"],
                     group_id=names["group"], command=("run", "--config", str(config)))  # fmt: skip
    cascade = {f"c-{i}": rng.integers(0, 256, (int(rng.integers(24, 64)),
                                               int(rng.integers(24, 64)), 1)).astype(np.uint8)
               for i in range(16)}  # fmt: skip
    gated = {f"g-{i}": {"raw": rng.normal(1.5, 1.0, 4).astype(np.float32),
                        "ids": rng.integers(1, 50, 3).astype(np.int64)} for i in range(40)}
    twice = {f"t-{i}": rng.integers(0, 256, (int(rng.integers(24, 48)),
                                             int(rng.integers(24, 48)), 1)).astype(np.uint8)
             for i in range(16)}  # fmt: skip
    total = len(scored) + len(read) + len(cascade) + len(gated) + len(twice)
    c = Collector(broker.bootstrap, [names["results"], names["dlq"]])
    try:
        await asyncio.to_thread(
            w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 10, 90.0,
            "assignment"
        )
        for pipeline, tensors in (("scored", scored), ("gated", gated)):
            await produce_all(broker.bootstrap, topics[pipeline], [
                (rid.encode(), wire(rid, {k: Tensor.from_numpy(v) for k, v in r.items()}))
                for rid, r in tensors.items()])  # fmt: skip
        for pipeline, images in (("read", read), ("cascade", cascade), ("twice", twice)):
            await produce_all(broker.bootstrap, topics[pipeline], [
                (rid.encode(), wire(rid, {"pixels": Tensor.from_numpy(p)}))
                for rid, p in images.items()])  # fmt: skip
        await c.start()
        assert await c.collect(lambda c: c.count() >= total, 90.0), w.log_tail()
    finally:
        await c.stop()
        assert w.terminate() == 0, w.log_tail()
    assert not c.records.get(names["dlq"])
    results = {r.result().id: r.result() for r in c.records[names["results"]]}
    assert len(results) == total
    for rid, r in scored.items():
        got = results[rid]
        assert (got.status, got.model.name) == ("ok", "scored"), got.error
        features = fn.standardise(r["raw"])["features"]
        alone = run_alone(rank_path, {"features": features, "ids": r["ids"]})
        np.testing.assert_allclose(got.outputs["score"].to_numpy(), alone["score"], rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
        np.testing.assert_array_equal(got.outputs["features"].to_numpy(), features)
    for rid, pixels in read.items():
        got = results[rid]
        assert (got.status, got.model.name) == ("ok", "read"), got.error
        heat = run_alone(det_path, {"x": fn.as_floats(pixels)["x"]})["heat"]
        boxes = fn.peak_boxes(heat)["boxes"]
        crops = crop_boxes(pixels, boxes, size=(8, 8))["crops"]
        np.testing.assert_array_equal(got.outputs["boxes"].to_numpy(), boxes)
        np.testing.assert_array_equal(got.outputs["digit"].to_numpy()[:, 0],
                                      _digits_by_hand(crops))  # fmt: skip
    small = ImagePreprocess((32, 32), 1, 1 / 255, (0.0,), (1.0,), "NCHW", "float32")
    mixed = uneven = 0  # requests whose crops went both ways at the branch; of uneven strips
    for rid, pixels in cascade.items():
        got = results[rid]
        assert (got.status, got.model.name) == ("ok", "cascade"), got.error
        kept = _kept_by_hand(det_path, preprocess([pixels], small)[0], 3)
        boxes = fn.to_pixels(kept["boxes"], pixels)["boxes"]
        crops = crop_boxes(pixels, boxes, size=(8, 8))["crops"]
        np.testing.assert_array_equal(got.outputs["kept"].to_numpy(), kept["indices"])
        # A branch per region: the digits model ran on the lit crops alone, in order.
        lit = np.array([fn.bright(c)["go"][0] for c in crops], np.bool_)
        mixed += bool(lit.any() and not lit.all())
        np.testing.assert_array_equal(got.outputs["lit"].to_numpy()[:, 0], lit)
        assert got.partial is None
        digits = got.outputs["digit"].to_numpy()
        assert digits.shape == (int(lit.sum()), 3)
        if lit.any():
            np.testing.assert_array_equal(digits[:, 0], _digits_by_hand(crops[lit]))
        # Regions of different shapes, ragged: each crop's strip, read back per region.
        strips = [fn.strip(c)["row"] for c in crops]
        uneven += len({len(r) for r in strips}) > 1
        got_strips = got.regions("row")
        assert len(got_strips) == len(strips)
        for a, b in zip(got_strips, strips, strict=True):
            np.testing.assert_array_equal(a, b)
    assert mixed and uneven, (mixed, uneven)
    skipped = failed = 0
    for rid, r in gated.items():
        got = results[rid]
        assert (got.status, got.model.name) == ("ok", "gated"), got.error
        go = bool(r["raw"][0] > 1.5)
        fails = bool(r["raw"][1] < 0)
        assert got.outputs["go"].to_numpy().tolist() == [int(go)]
        want_partial: dict[str, object] = {}
        if go:  # the expensive model ran: its answer as by hand
            alone = run_alone(rank_path, {"features": r["raw"], "ids": r["ids"]})
            np.testing.assert_allclose(got.outputs["score"].to_numpy(), alone["score"],
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
        else:  # skipped: no score, and the answer says why
            assert "score" not in got.outputs
            want_partial["skipped"] = ["rank"]
            skipped += 1
        if fails:  # the optional step failed it: the rest answered, the step named
            assert "checked" not in got.outputs
            want_partial["failed"] = [{"step": "check", "code": "inference_failed",
                                       "message": f"ValueError: feature 1 is "
                                                  f"{r['raw'][1]:.3f}, under 0"}]  # fmt: skip
            failed += 1
        else:
            np.testing.assert_allclose(got.outputs["checked"].to_numpy(),
                                       np.sqrt(r["raw"][1:2]), rtol=1e-6)  # fmt: skip
        assert got.partial == (want_partial or None), (rid, got.partial)
    assert 0 < skipped < len(gated) and 0 < failed < len(gated), (skipped, failed)
    for rid, pixels in twice.items():  # two fan-outs: regions, then a region each again
        got = results[rid]
        assert (got.status, got.model.name) == ("ok", "twice"), got.error
        kept = _kept_by_hand(det_path, fn.as_floats(pixels)["x"], 2)
        split = fn.regions(pixels, kept["boxes"])
        refined = np.stack([fn.refine(c, b)["box"] for c, b in zip(split["crop"], split["box"],
                                                                    strict=True)])  # fmt: skip
        crops = np.concatenate([crop_boxes(pixels, b, size=(8, 8))["crops"] for b in refined])
        np.testing.assert_array_equal(got.outputs["first"].to_numpy(), split["box"])
        np.testing.assert_array_equal(got.outputs["refined"].to_numpy(), refined)
        np.testing.assert_array_equal(got.outputs["digit"].to_numpy()[:, 0],
                                      _digits_by_hand(crops))  # fmt: skip
