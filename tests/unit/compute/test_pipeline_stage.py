"""A pipeline's stage (``worker.compute.pipeline``) over the bundled digits model
and a function: each request answered with the pipeline's outputs, equal to the
model and the function run by hand; a request a step fails is answered naming
the step while the others go on; a step whose share of the deadline is spent
does not start; a fan-out step's regions run as one batch of the next model and
are stacked per request."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from tests.models import cpu_stage
from tests.pipeline_functions import doubled
from worker.compute.engines import load_engine
from worker.compute.pipeline import PipelineStage
from worker.compute.steps import FunctionStep, ModelStep, PipelinePlan
from worker.config import ModelConfig
from worker.config.pipelines import Spec
from worker.contract import Request
from worker.flow.messages import Batch, Completed, Job, TopicPartition
from worker.model.io import EngineInfo


def _jobs(n: int, deadline: float | None = None, ago: float = 0.0) -> list[Job]:
    rng = np.random.default_rng(3)
    now = time.monotonic()
    out = []
    for i in range(n):
        job = Job(TopicPartition("in", 0), i, None, now - ago,
                  None if deadline is None else now + deadline,
                  request=Request(v=1, id=f"r{i}", inputs={}))  # fmt: skip
        job.inputs["image"] = rng.integers(0, 255, (8, 8, 1), dtype=np.uint8)
        out.append(job)
    return out


async def _run(function: Callable[..., object], jobs: list[Job], until: float | None = None
               ) -> tuple[Completed, Completed]:  # fmt: skip
    """The pipeline's answers, and the digits model's own on the same jobs."""
    engine = load_engine(ModelConfig())
    alone, inner = cpu_stage(ModelConfig(), engine), cpu_stage(ModelConfig(), engine)
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    steps = [ModelStep("d", inner, {"image": "request.image"}),
             FunctionStep("f", function, {"x": "d.topk_scores"}, {"y": Spec("float32", (3,))},
                          until)]  # fmt: skip
    plan = PipelinePlan(tuple(steps), {"scores": "f.y", "classes": "d.topk_indices"}, {}, {})
    stage = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, inner.binding, plan,
                          max_inflight=1)
    try:
        done = await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
        own = await alone.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        stage.close()
        alone.close()
    return done, own


async def test_answers_equal_the_model_and_the_function_by_hand() -> None:
    done, own = await _run(doubled, _jobs(6))
    for got, want in zip(done.answers, own.answers, strict=True):
        assert got.error is None and got.outputs is not None and want.outputs is not None
        np.testing.assert_array_equal(got.outputs["scores"], want.outputs["topk_scores"] * 2)
        np.testing.assert_array_equal(got.outputs["classes"], want.outputs["topk_indices"])


async def test_a_failing_step_is_named_and_the_others_go_on() -> None:
    def picky(x: np.ndarray) -> dict[str, np.ndarray]:
        if x[0] > 0.8:
            raise ValueError("too sure")
        return doubled(x)

    done, own = await _run(picky, _jobs(8))
    sure = [a.outputs is not None and a.outputs["topk_scores"][0] > 0.8 for a in own.answers]
    assert any(sure) and not all(sure)
    for got, failed in zip(done.answers, sure, strict=True):
        if failed:
            assert got.error is not None and got.error.code == "inference_failed"
            assert got.error.message == "step 'f': ValueError: too sure"
        else:
            assert got.error is None


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        (lambda x: {"y": x.astype(np.float64)}, "output 'y': float64 [3], declared float32 [3]"),
        (lambda x: {"z": x}, "output 'y': missing or not a numpy array"),
        (lambda x: [x], "returned list, not a dict of arrays"),
    ],
)  # fmt: skip
async def test_a_function_not_returning_what_it_declares_is_named(
    returned: Callable[..., object], problem: str
) -> None:
    done, _ = await _run(returned, _jobs(2))
    for answer in done.answers:
        assert answer.error is not None and answer.error.message == f"step 'f': {problem}"


async def test_a_step_whose_deadline_share_is_spent_does_not_start() -> None:
    # Arrived 1 s ago with 1 s left: the steps up to f had a quarter of 2 s, spent.
    from worker.obs import metrics

    expired = metrics.EXPIRED.labels(rule="step_share")
    before = expired._value.get()
    late = _jobs(3, deadline=1.0, ago=1.0)
    done, _ = await _run(doubled, late, until=0.25)
    assert expired._value.get() == before + 3  # counted as triage counts its expiries
    for answer in done.answers:
        assert answer.error is not None and answer.error.code == "deadline_exceeded"
        assert answer.error.message == ("step 'f': the steps up to it had 25% of the request's "
                                        "deadline, spent before it started")  # fmt: skip
    on_time, _ = await _run(doubled, _jobs(3, deadline=1.0, ago=1.0), until=0.9)
    assert all(a.error is None for a in on_time.answers)
    no_deadline, _ = await _run(doubled, _jobs(3), until=0.01)
    assert all(a.error is None for a in no_deadline.answers)


async def test_a_fan_out_runs_each_region_and_stacks_them_per_request() -> None:
    from tests.pipeline_functions import tiles
    from worker.app.pipelines import StepModel, build_plan
    from worker.config import PipelineConfig, StepConfig

    engine = load_engine(ModelConfig())
    first, regions, alone = (cpu_stage(ModelConfig(), engine) for _ in range(3))
    cfg = PipelineConfig(topics=("in",), steps=(
        StepConfig(name="d", model="digits"),
        StepConfig(name="cut", function="tests.pipeline_functions:tiles", fan_out=True,
                   inputs={"image": "request.image"}, outputs={"tile": "uint8 [8, 8, 1]"}),
        StepConfig(name="each", model="digits", inputs={"image": "cut.tile"}),
    ), outputs={"first": "d.topk_indices", "classes": "each.topk_indices"})  # fmt: skip
    models = {"digits": StepModel(engine.info, first.binding, first)}
    built = build_plan("p", cfg, models)
    each = ModelStep("each", regions, {"image": "cut.tile"})  # its own stage, as built
    built = dataclasses.replace(built, steps=(*built.steps[:2], each))
    assert built.regional["each.topk_indices"] == ("int64", (3,))
    assert built.regional["cut.tile"] == ("uint8", (8, 8, 1))
    assert "d.topk_indices" not in built.regional
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    stage = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, first.binding, built,
                          max_inflight=1)
    jobs = _jobs(9)
    try:
        done = await stage.run_batch(Batch(jobs, time.monotonic(), "full"))
        counts = [int(j.inputs["image"][0, 0, 0]) % 3 for j in jobs]
        assert sorted(set(counts)) == [0, 1, 2]
        for job, answer, n in zip(jobs, done.answers, counts, strict=True):
            assert answer.error is None and answer.outputs is not None
            classes = answer.outputs["classes"]
            assert classes.shape == (n, 3) and classes.dtype == np.int64
            cut = tiles(job.inputs["image"])["tile"]
            each = [msgspec.structs.replace(job, inputs={"image": c}) for c in cut]
            if each:  # every region equal to the model run on it alone
                own = await alone.run_batch(Batch(each, time.monotonic(), "full"))
                want = np.stack([a.outputs["topk_indices"] for a in own.answers if a.outputs])
                np.testing.assert_array_equal(classes, want)
    finally:
        stage.close()
        alone.close()


async def test_a_batch_over_the_stage_s_size_runs_in_parts_with_no_failure() -> None:
    """A pipeline's step after a fan-out hands its model's stage every region of
    a batch: more rows than its buffers hold, run in parts of their size (it was
    a failed run, bisected, before the answers came)."""
    stage = cpu_stage(ModelConfig(), max_batch_size=4)
    failures = stage._metrics.batch_failures
    before = failures._value.get()
    try:
        done = await stage.run_batch(Batch(_jobs(10), time.monotonic(), "full"))
    finally:
        stage.close()
    assert done.engine_rows == 10
    assert all(a.error is None and a.outputs is not None for a in done.answers)
    assert failures._value.get() == before
