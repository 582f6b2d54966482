"""``op = "crop_boxes"`` (``worker.compute.ops.crops``): each box's pixels resized as
Pillow resizes them, clipped to the image; a box with no pixel refused by name;
and as a pipeline's step, between the digits model and the digits model again."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import numpy as np
import pytest
from PIL import Image

from tests.models import cpu_stage
from tests.unit.compute.test_pipeline_stage import _jobs
from worker.app.pipelines import StepModel, build_plan
from worker.compute.engines import load_engine
from worker.compute.ops.crops import crop_boxes
from worker.compute.pipeline import PipelineStage
from worker.compute.steps import ModelStep
from worker.config import ModelConfig, PipelineConfig, StepConfig
from worker.flow.messages import Batch
from worker.model.io import EngineInfo


def test_each_box_is_its_pixels_resized_as_pillow_resizes_them() -> None:
    rng = np.random.default_rng(5)
    image = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    crops = crop_boxes(image, np.array([[2, 3, 12, 18], [-5, -5, 40, 40]]), (6, 8))["crops"]
    assert crops.shape == (2, 6, 8, 3) and crops.dtype == np.uint8
    want = np.asarray(Image.fromarray(image[3:18, 2:12]).resize((8, 6), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(crops[0], want)
    whole = np.asarray(Image.fromarray(image).resize((8, 6), Image.Resampling.BILINEAR))
    np.testing.assert_array_equal(crops[1], whole)  # clipped to the image
    grey = crop_boxes(image[:, :, 0], np.zeros((0, 4)), (6, 8))["crops"]
    assert grey.shape == (0, 6, 8, 1)


def test_a_box_without_pixels_is_refused_by_name() -> None:
    image = np.zeros((10, 10, 1), np.uint8)
    with pytest.raises(ValueError, match=r"box 1 \(20, 0, 30, 5\) holds no pixel of the 10x10"):
        crop_boxes(image, np.array([[0, 0, 5, 5], [20, 0, 30, 5]]), (4, 4))


async def test_crops_between_two_models_answer_as_each_crop_alone() -> None:
    engine = load_engine(ModelConfig())
    first, each, alone = (cpu_stage(ModelConfig(), engine) for _ in range(3))
    cfg = PipelineConfig(topics=("in",), steps=(
        StepConfig(name="d", model="digits"),
        StepConfig(name="find", function="tests.pipeline_functions:corner_boxes",
                   inputs={"image": "request.image"}, outputs={"boxes": "float32 [2, 4]"}),
        StepConfig(name="crop", op="crop_boxes", size=(8, 8),
                   inputs={"image": "request.image", "boxes": "find.boxes"}),
        StepConfig(name="each", model="digits", inputs={"image": "crop.crops"}),
    ), outputs={"classes": "each.topk_indices", "crops": "crop.crops",
                "box": "crop.box"})  # fmt: skip
    built = build_plan("p", cfg, {"digits": StepModel(engine.info, first.binding,
                                                                  first)})  # fmt: skip
    built = dataclasses.replace(built, steps=(*built.steps[:3], ModelStep(
        "each", each, {"image": "crop.crops"})))  # a stage of its own
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    stage = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, first.binding, built,
                          max_inflight=1)
    jobs = _jobs(4)
    try:
        done = await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
        for job, answer in zip(jobs, done.answers, strict=True):
            assert answer.error is None and answer.outputs is not None
            image = job.inputs["image"]
            crops = crop_boxes(image, np.array([[0, 0, 8, 8], [0, 0, 4, 4]]), (8, 8))["crops"]
            np.testing.assert_array_equal(answer.outputs["crops"], crops)
            np.testing.assert_array_equal(answer.outputs["box"],  # where each crop is from
                                          np.array([[0, 0, 8, 8], [0, 0, 4, 4]], np.float32))
            own = await alone.run_batch(Batch([msgspec.structs.replace(job, inputs={"image": c})
                                               for c in crops], time.monotonic(), "full"))
            want = np.stack([a.outputs["topk_indices"] for a in own.answers if a.outputs])
            np.testing.assert_array_equal(answer.outputs["classes"], want)
    finally:
        stage.close()
        alone.close()
