"""A pipeline's model steps run as columns (``worker.compute.columns``): a model
of fixed-shape tensor inputs after a function runs its rows as one whole-batch
array, on the thread the function ran on, every answer equal to the model's own
stage running the same rows as jobs; where a row is not what the model takes (a
free dimension the plan could not fix) the step runs as jobs instead and names
that request alone; a request past its deadline is answered as a model's stage
answers it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tests.models import cpu_stage
from tests.onnx_models import tabular
from tests.pipeline_functions import standardise
from worker.app.pipelines import StepModel, build_plan
from worker.compute.cpu import CpuStage
from worker.compute.engines import load_engine
from worker.compute.pipeline import PipelineStage
from worker.config import ModelConfig, PipelineConfig, StepConfig
from worker.contract import Request
from worker.flow.messages import Batch, Completed, Job, TopicPartition
from worker.model.io import EngineInfo

pytest.importorskip("onnx")


def _jobs(raws: list[np.ndarray], deadline: float | None = None) -> list[Job]:
    now = time.monotonic()
    return [Job(TopicPartition("in", 0), i, None, now, deadline,
                request=Request(v=1, id=f"r{i}", inputs={}), inputs={"raw": raw})
            for i, raw in enumerate(raws)]  # fmt: skip


Served = tuple[Completed, CpuStage, PipelineStage]


async def _serve(tmp_path: Path, function: str, features: str, jobs: list[Job],
                 vectorized: bool = False, max_batch: int = 64) -> Served:  # fmt: skip
    cfg = ModelConfig(path=str(tabular(tmp_path / "tabular.onnx")))
    engine = load_engine(cfg)
    stage = cpu_stage(cfg, engine, max_batch_size=max_batch)
    pipeline = PipelineConfig(topics=("in",), inputs={"raw": "float32 [4]"}, steps=(
        StepConfig(name="norm", function=function, inputs={"raw": "request.raw"},
                   outputs={"features": features}, vectorized=vectorized),
        StepConfig(name="t", model="tabular", inputs={"features": "norm.features"}),
    ), outputs={"score": "t.score", "features": "norm.features"})  # fmt: skip
    plan = build_plan("p", pipeline, {"tabular": StepModel(engine.info, stage.binding, stage)})
    assert plan.steps[1].columnar  # a model of fixed-shape tensor inputs
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    served = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, stage.binding, plan,
                           max_inflight=2)  # fmt: skip
    return await served.run_batch(Batch(jobs, time.monotonic(), "full")), stage, served


async def _alone(stage: CpuStage, jobs: list[Job]) -> Completed:
    """The model's own stage on the same rows, as jobs."""
    mine = [msgspec.structs.replace(j, inputs={"features": standardise(j.inputs["raw"])[
        "features"]}) for j in jobs]  # fmt: skip
    return await stage.run_batch(Batch(mine, time.monotonic(), "full"))


async def test_a_model_step_runs_as_columns_equal_to_its_stage_s_jobs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    jobs = _jobs([rng.normal(1.0, 2.0, 4).astype(np.float32) for _ in range(37)])
    done, stage, served = await _serve(tmp_path, "tests.pipeline_functions:standardise",
                                       "float32 [4]", jobs)  # fmt: skip
    try:
        assert done.engine_rows == 37
        own = await _alone(stage, jobs)
        for got, want in zip(done.answers, own.answers, strict=True):
            assert got.error is None and got.outputs is not None and want.outputs is not None
            np.testing.assert_allclose(got.outputs["score"], want.outputs["score"], rtol=1e-6)
            assert set(got.timing_us) >= {"queue", "preprocess", "infer", "d2h"}
    finally:
        served.close()


async def test_a_row_the_model_does_not_take_runs_the_step_as_jobs_naming_it(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(1)
    raws = [rng.normal(1.0, 2.0, 4).astype(np.float32) for _ in range(9)]
    raws[4] = raws[4].copy()
    raws[4][0] = 99.0  # the function cuts this one short: 3 features
    jobs = _jobs(raws)
    done, stage, served = await _serve(tmp_path, "tests.pipeline_functions:short_when_large",
                                       "float32 [n]", jobs)  # fmt: skip
    try:
        bad = done.answers[4]
        assert bad.error is not None and bad.error.code == "inference_failed"
        assert bad.error.message.startswith("step 't': inputs.features.shape[0]: expected 4")
        good = [j for k, j in enumerate(jobs) if k != 4]
        own = await _alone(stage, good)
        for got, want in zip([a for k, a in enumerate(done.answers) if k != 4], own.answers,
                             strict=True):  # fmt: skip
            assert got.error is None and got.outputs is not None and want.outputs is not None
            np.testing.assert_allclose(got.outputs["score"], want.outputs["score"], rtol=1e-6)
    finally:
        served.close()


async def test_a_request_past_its_deadline_is_answered_as_a_model_s_stage_does(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(2)
    jobs = _jobs([rng.normal(size=4).astype(np.float32) for _ in range(3)],
                 deadline=time.monotonic() - 1.0)  # fmt: skip
    done, _, served = await _serve(tmp_path, "tests.pipeline_functions:standardise",
                                   "float32 [4]", jobs)  # fmt: skip
    try:
        assert done.engine_rows == 0
        for answer in done.answers:
            assert answer.error is not None and answer.error.code == "deadline_exceeded"
            assert answer.error.message == "deadline passed before inference"
    finally:
        served.close()


async def test_a_vectorized_function_is_called_once_a_batch_and_feeds_the_model_as_it_is(
    tmp_path: Path,
) -> None:
    from tests.pipeline_functions import SEEN_ROWS

    rng = np.random.default_rng(3)
    jobs = _jobs([rng.normal(1.0, 2.0, 4).astype(np.float32) for _ in range(29)])
    SEEN_ROWS.clear()
    done, stage, served = await _serve(tmp_path, "tests.pipeline_functions:standardise_rows",
                                       "float32 [4]", jobs, vectorized=True)  # fmt: skip
    try:
        assert SEEN_ROWS == [29]  # one call, every row
        own = await _alone(stage, jobs)
        for got, want in zip(done.answers, own.answers, strict=True):
            assert got.error is None and got.outputs is not None and want.outputs is not None
            np.testing.assert_allclose(got.outputs["score"], want.outputs["score"], rtol=1e-6)
            np.testing.assert_array_equal(got.outputs["features"],
                                          standardise(got.job.inputs["raw"])["features"])
    finally:
        served.close()


async def test_a_vectorized_function_failing_a_batch_fails_only_the_rows_that_fail_it(
    tmp_path: Path,
) -> None:
    from tests.pipeline_functions import SEEN_ROWS

    rng = np.random.default_rng(4)
    raws = [rng.normal(1.0, 2.0, 4).astype(np.float32) for _ in range(6)]
    raws[2] = raws[2].copy()
    raws[2][0] = 99.0
    SEEN_ROWS.clear()
    done, _, served = await _serve(tmp_path, "tests.pipeline_functions:standardise_rows",
                                   "float32 [4]", _jobs(raws), vectorized=True)  # fmt: skip
    try:
        assert SEEN_ROWS == [6, 1, 1, 1, 1, 1, 1]  # the batch, then row by row (one each)
        for k, answer in enumerate(done.answers):
            if k == 2:
                assert answer.error is not None
                assert answer.error.message == "step 'norm': ValueError: 1 rows over 50"
            else:
                assert answer.error is None
    finally:
        served.close()


async def test_more_rows_than_the_model_s_batch_size_run_in_parts_of_that_size(
    tmp_path: Path,
) -> None:
    """A step after a fan-out hands in every region of a batch: as columns, too,
    they run in runs of at most max_batch_size rows."""
    from worker.obs import metrics

    def runs() -> float:  # the tabular model's engine runs so far (one file: one version)
        return sum(s.value for m in metrics.BATCH_SIZE.collect() for s in m.samples
                   if s.name.endswith("_count") and s.labels.get("model") == "tabular")

    rng = np.random.default_rng(5)
    jobs = _jobs([rng.normal(1.0, 2.0, 4).astype(np.float32) for _ in range(37)])
    before = runs()
    done, stage, served = await _serve(tmp_path, "tests.pipeline_functions:standardise",
                                       "float32 [4]", jobs, max_batch=8)  # fmt: skip
    try:
        assert runs() - before == 5  # 8 + 8 + 8 + 8 + 5
        own = await _alone(stage, jobs)
        for got, want in zip(done.answers, own.answers, strict=True):
            assert got.error is None and got.outputs is not None and want.outputs is not None
            np.testing.assert_allclose(got.outputs["score"], want.outputs["score"], rtol=1e-6)
    finally:
        served.close()


async def test_a_vectorized_function_cannot_change_an_earlier_step_s_output(
    tmp_path: Path,
) -> None:
    """An earlier model step's output, fed to a vectorized function as it is,
    is read only: a function writing into it fails its request by name instead
    of changing what the earlier step answered."""
    from tests.onnx_models import tabular

    cfg = ModelConfig(path=str(tabular(tmp_path / "tabular.onnx")))
    engine = load_engine(cfg)
    stage = cpu_stage(cfg, engine)
    pipeline = PipelineConfig(topics=("in",), inputs={"raw": "float32 [4]"}, steps=(
        StepConfig(name="t", model="tabular", inputs={"features": "request.raw"}),
        StepConfig(name="twice", function="tests.pipeline_functions:doubled_in_place",
                   vectorized=True, inputs={"p": "t.probabilities"},
                   outputs={"p": "float32 [3]"}),
    ), outputs={"p": "t.probabilities", "twice": "twice.p"})  # fmt: skip
    plan = build_plan("p", pipeline, {"tabular": StepModel(engine.info, stage.binding, stage)})
    info = EngineInfo("pipeline", "p", "pipeline:test", engine.info.io, None)
    served = PipelineStage(asyncio.Queue(), asyncio.Queue(), info, stage.binding, plan,
                           max_inflight=1)  # fmt: skip
    rng = np.random.default_rng(6)
    jobs = _jobs([rng.normal(size=4).astype(np.float32) for _ in range(4)])
    try:
        done = await served.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        served.close()
    for answer in done.answers:
        assert answer.error is not None and "read-only" in answer.error.message
