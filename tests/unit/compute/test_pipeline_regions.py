"""A pipeline's regions (after a fan-out, ``worker.compute.pipeline``): a branch
per region runs its step on the regions where it is true (and the steps reading
its outputs on those alone), and a per-region output whose regions differ in
shape answered in the ragged layout (every region's values, flat, and
``NAME.shapes``), or, not declared ragged, refused for that request by name."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import numpy as np
import pytest

from tests.models import cpu_stage
from tests.pipeline_functions import bright, strip, tiles
from tests.unit.compute.test_pipeline_stage import _jobs
from worker.app.pipelines import StepModel, build_plan
from worker.compute.engines import load_engine
from worker.compute.pipeline import PipelineStage
from worker.config import ModelConfig, PipelineConfig, StepConfig
from worker.flow.errors import ConfigError
from worker.flow.messages import Batch, Completed, Job
from worker.model.io import EngineInfo

STEPS = (
    StepConfig(name="d", model="digits"),
    StepConfig(name="cut", function="tests.pipeline_functions:tiles", fan_out=True,
               inputs={"image": "request.image"}, outputs={"tile": "uint8 [8, 8, 1]"}),
    StepConfig(name="gate", function="tests.pipeline_functions:bright",
               inputs={"tile": "cut.tile"}, outputs={"go": "bool [1]"}),
    StepConfig(name="each", model="digits", inputs={"image": "cut.tile"}, when="gate.go"),
    StepConfig(name="strip", function="tests.pipeline_functions:strip",
               inputs={"tile": "cut.tile"}, outputs={"row": "uint8 [n]"}),
)  # fmt: skip
OUTPUTS = {"classes": "each.topk_indices", "go": "gate.go", "row": "strip.row"}


async def _serve(jobs: list[Job], ragged: tuple[str, ...]) -> Completed:
    engine = load_engine(ModelConfig())
    first, each = cpu_stage(ModelConfig(), engine), cpu_stage(ModelConfig(), engine)
    cfg = PipelineConfig(topics=("in",), steps=STEPS, outputs=OUTPUTS, ragged=ragged)
    plan = build_plan("p", cfg, {"digits": StepModel(engine.info, first.binding, first)})
    plan = dataclasses.replace(plan, steps=(*plan.steps[:3], dataclasses.replace(
        plan.steps[3], stage=each), plan.steps[4]))  # the regions' model: a stage of its own
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    stage = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, first.binding, plan,
                          max_inflight=2)  # fmt: skip
    try:
        return await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        stage.close()


async def _alone(job: Job, images: list[np.ndarray]) -> np.ndarray:
    engine = load_engine(ModelConfig())
    alone = cpu_stage(ModelConfig(), engine)
    try:
        own = await alone.run_batch(Batch([msgspec.structs.replace(job, inputs={"image": i})
                                           for i in images], time.monotonic(), "full"))
    finally:
        alone.close()
    return np.stack([a.outputs["topk_indices"] for a in own.answers if a.outputs])


async def test_a_branch_per_region_runs_its_step_where_true_and_ragged_outputs_carry_shapes(
) -> None:  # fmt: skip
    jobs = _jobs(24)
    done = await _serve(jobs, ragged=("row",))
    seen_mixed = False
    for job, answer in zip(jobs, done.answers, strict=True):
        assert answer.error is None and answer.outputs is not None, answer.error
        assert answer.partial is None  # a region a branch passed by is not a partial answer
        cut = list(tiles(job.inputs["image"])["tile"])
        go = [bool(bright(t)["go"][0]) for t in cut]
        seen_mixed |= any(go) and not all(go)
        out = answer.outputs
        np.testing.assert_array_equal(out["go"], np.array(go, np.bool_).reshape(len(cut), 1))
        chosen = [t for t, g in zip(cut, go, strict=True) if g]
        assert out["classes"].shape == (len(chosen), 3)
        if chosen:  # the rows of the regions it ran on, in region order, as each alone
            np.testing.assert_array_equal(out["classes"], await _alone(job, chosen))
        rows = [strip(t)["row"] for t in cut]  # ragged: every region's values, then shapes
        assert out["row.shapes"].dtype == np.int64
        np.testing.assert_array_equal(out["row.shapes"], np.array([[len(r)] for r in rows],
                                                                  np.int64).reshape(-1, 1))
        want = np.concatenate(rows) if rows else np.zeros(0, np.uint8)
        assert out["row"].dtype == np.uint8
        np.testing.assert_array_equal(out["row"], want)
    assert seen_mixed  # some request had regions on both sides of the branch


async def test_regions_of_different_shapes_not_declared_ragged_fail_the_request_by_name(
) -> None:  # fmt: skip
    jobs = _jobs(24)
    done = await _serve(jobs, ragged=())
    differ = empty = 0
    for job, answer in zip(jobs, done.answers, strict=True):
        lengths = {len(strip(t)["row"]) for t in tiles(job.inputs["image"])["tile"]}
        if len(lengths) > 1:
            differ += 1
            assert answer.error is not None and answer.error.code == "inference_failed"
            assert answer.error.message.startswith("output 'row': its regions differ in shape")
            assert "pipelines.p.ragged = ['row']" in answer.error.message
        else:
            assert answer.error is None and answer.outputs is not None
            regions = len(tiles(job.inputs["image"])["tile"])
            assert answer.outputs["row"].shape[0] == regions
            assert answer.outputs["row"].ndim == 2  # [regions, n]: [0, 0] without any
            empty += regions == 0
    assert differ and empty  # the batch had such requests, and the others were answered


def test_only_a_per_region_output_is_answered_ragged() -> None:
    engine = load_engine(ModelConfig())
    first = cpu_stage(ModelConfig(), engine)
    cfg = PipelineConfig(topics=("in",), steps=STEPS, outputs={**OUTPUTS, "d": "d.topk_indices"},
                         ragged=("row", "d"))  # fmt: skip
    try:
        with pytest.raises(ConfigError, match=r"pipelines\.p\.ragged: 'd' \('d\.topk_indices'\) "
                                              r"is one tensor a request"):
            build_plan("p", cfg, {"digits": StepModel(engine.info, first.binding, first)})
        plan = build_plan("p", dataclasses.replace(cfg, ragged=("row",), outputs=OUTPUTS),
                          {"digits": StepModel(engine.info, first.binding, first)})
        assert plan.described["row"] == ("uint8", ("values",))
        assert plan.described["row.shapes"] == ("int64", ("regions", 1))
        assert plan.described["classes"] == ("int64", ("regions", 3))
    finally:
        first.close()


async def test_a_ragged_output_of_two_dimensions_a_region_carries_each_region_s_shape() -> None:
    from tests.pipeline_functions import corner

    steps = (*STEPS[:2], StepConfig(name="corner", function="tests.pipeline_functions:corner",
                                    inputs={"tile": "cut.tile"},
                                    outputs={"block": "uint8 [k, 2]"}))  # fmt: skip
    engine = load_engine(ModelConfig())
    first = cpu_stage(ModelConfig(), engine)
    cfg = PipelineConfig(topics=("in",), steps=steps, outputs={"block": "corner.block"},
                         ragged=("block",))  # fmt: skip
    plan = build_plan("p", cfg, {"digits": StepModel(engine.info, first.binding, first)})
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    stage = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, first.binding, plan,
                          max_inflight=1)  # fmt: skip
    jobs = _jobs(12)
    try:
        done = await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        stage.close()
    for job, answer in zip(jobs, done.answers, strict=True):
        assert answer.error is None and answer.outputs is not None, answer.error
        want = [corner(t)["block"] for t in tiles(job.inputs["image"])["tile"]]
        shapes = answer.outputs["block.shapes"]
        assert shapes.shape == (len(want), 2)  # [regions, rank]: [0, 2] without any
        np.testing.assert_array_equal(shapes, np.array([w.shape for w in want], np.int64)
                                      .reshape(-1, 2))  # fmt: skip
        flat = np.concatenate([w.ravel() for w in want]) if want else np.zeros(0, np.uint8)
        np.testing.assert_array_equal(answer.outputs["block"], flat)
