"""A pipeline's built-in operations on the GPU (``worker.compute.ops.device``),
where the pipeline runs a model there: nms, crop_boxes and resize run every
unit of a batch at once by the CuPy kernels, here through the GPU stage's CPU
twin (``gpu-twin``), and answer exactly as the NumPy operations; a batch the
device refuses (a box with no pixel) runs on the host, which names the request."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tests.models import cpu_stage
from tests.unit.compute.test_pipeline_stage import _jobs
from worker.app.pipelines import StepModel, build_plan
from worker.compute.engines import load_engine
from worker.compute.ops.device import Args, DeviceOps
from worker.compute.pipeline import PipelineStage
from worker.compute.steps import FunctionStep, PipelinePlan
from worker.config import ModelConfig, PipelineConfig, StepConfig
from worker.config.pipelines import StepPreprocess
from worker.flow.messages import Batch, Completed
from worker.model.io import EngineInfo

PIPELINE = PipelineConfig(topics=("in",), inputs={"pixels": "uint8 [H, W, 1]"}, steps=(
    StepConfig(name="find", function="tests.pipeline_functions:scattered_boxes",
               inputs={"pixels": "request.pixels"},
               outputs={"boxes": "float32 [n, 4]", "scores": "float32 [n]"}),
    StepConfig(name="keep", op="nms", iou_threshold=0.3,
               inputs={"boxes": "find.boxes", "scores": "find.scores"}),
    StepConfig(name="crop", op="crop_boxes", size=(8, 8),
               inputs={"image": "request.pixels", "boxes": "keep.boxes"}),
    StepConfig(name="small", op="resize", inputs={"image": "crop.crops"},
               preprocess=StepPreprocess(size=(6, 5), channels=1, mean=(0.5,), std=(0.25,))),
    StepConfig(name="digit", model="digits", inputs={"image": "crop.crops"}),
), outputs={"kept": "keep.indices", "crops": "crop.crops", "small": "small.image",
            "digit": "digit.topk_indices"})  # fmt: skip


def _counted(plan: PipelinePlan, calls: list[str]) -> PipelinePlan:
    """``plan`` with each op's device form noting its calls (to tell the device
    ran them, not the host)."""

    def noting(step: FunctionStep) -> FunctionStep:
        batched = step.batched
        assert batched is not None

        def run(args: Sequence[Args]) -> Any:
            calls.append(step.name)
            return batched(args)

        return dataclasses.replace(step, batched=run)

    return dataclasses.replace(plan, steps=tuple(
        noting(s) if isinstance(s, FunctionStep) and s.batched is not None else s
        for s in plan.steps))  # fmt: skip


async def _serve(jobs: list[Any], device: DeviceOps | None, calls: list[str]) -> Completed:
    engine = load_engine(ModelConfig())
    stage = cpu_stage(ModelConfig(), engine)
    plan = build_plan("p", PIPELINE, {"digits": StepModel(engine.info, stage.binding, stage)},
                      device)  # fmt: skip
    if device is not None:
        plan = _counted(plan, calls)
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    served = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, stage.binding, plan,
                           max_inflight=2)  # fmt: skip
    try:
        return await served.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        served.close()


def _pixels(n: int, outside: bool) -> list[Any]:
    jobs = _jobs(n)
    rng = np.random.default_rng(7)
    for k, job in enumerate(jobs):
        pixels = rng.integers(0, 256, (int(rng.integers(12, 40)), int(rng.integers(12, 40)), 1),
                              dtype=np.uint8)  # fmt: skip
        pixels[0, 1, 0] = 255 if outside and k % 3 == 0 else min(int(pixels[0, 1, 0]), 250)
        job.inputs.clear()
        job.inputs["pixels"] = pixels
    return jobs


async def test_ops_on_the_device_answer_as_the_numpy_operations() -> None:
    jobs = _pixels(16, outside=False)
    calls: list[str] = []
    on_device = await _serve(jobs, DeviceOps.on("gpu-twin", 0), calls)
    on_host = await _serve(jobs, None, [])
    assert sorted(set(calls)) == ["crop", "keep", "small"]  # each op's batch on the device
    assert calls.count("crop") == 1  # every request's crops in one go
    for got, want in zip(on_device.answers, on_host.answers, strict=True):
        assert got.error is None and want.error is None, (got.error, want.error)
        assert got.outputs is not None and want.outputs is not None
        assert got.outputs.keys() == want.outputs.keys()
        for name in want.outputs:
            np.testing.assert_array_equal(got.outputs[name], want.outputs[name], err_msg=name)


async def test_a_batch_the_device_refuses_runs_on_the_host_naming_the_request() -> None:
    jobs = _pixels(16, outside=True)
    calls: list[str] = []
    done = await _serve(jobs, DeviceOps.on("gpu-twin", 0), calls)
    host = await _serve(jobs, None, [])
    refused = [j.inputs["pixels"][0, 1, 0] > 250 for j in jobs]
    assert any(refused) and not all(refused)
    for got, want, bad in zip(done.answers, host.answers, refused, strict=True):
        if bad:  # as the host names it: the box with no pixel
            assert got.error is not None and want.error is not None
            assert got.error.message == want.error.message
            assert "holds no pixel" in got.error.message
        else:
            assert got.error is None and got.outputs is not None and want.outputs is not None
            for name in want.outputs:
                np.testing.assert_array_equal(got.outputs[name], want.outputs[name])
