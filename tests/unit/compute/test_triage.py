"""Poison isolation in the CPU inference stage: a batch that fails is split until
the failing request is alone; everything else in it is answered normally."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from prometheus_client import REGISTRY

from tests.models import cpu_stage
from worker.compute.engines import load_engine
from worker.compute.triage import completed as answered
from worker.compute.triage import run_isolating, triage
from worker.config import ModelConfig
from worker.contract import ModelRef, Request
from worker.flow.errors import EngineDead, InferenceFailed, InvalidRequest
from worker.flow.messages import Batch, Job, TopicPartition
from worker.model.io import EngineInfo
from worker.model.rows import Row
from worker.obs.metrics import ModelMetrics


class FailsOnBrightCorner:
    """The real bundled model, plus a failure for any batch holding an image whose
    top-left value is high (as a data-dependent model bug would)."""

    def __init__(self, exc: type[Exception]) -> None:
        self._inner = load_engine(ModelConfig())
        self.info: EngineInfo = self._inner.info
        self._exc = exc
        self.runs = 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.runs += 1
        if (feeds["image"][:, 0, 0, 0] > 0.9).any():
            raise self._exc("bright corner")
        return self._inner.run(feeds)

    def close(self) -> None:
        self._inner.close()


def jobs(n: int, poison: set[int]) -> list[Job]:
    out = []
    for i in range(n):
        img = np.zeros((8, 8, 1), np.uint8)
        if i in poison:
            img[0, 0, 0] = 255
        job = Job(TopicPartition("in", 0), i, None, time.monotonic(), None)
        job.inputs["image"] = img
        out.append(job)
    return out


@pytest.mark.parametrize("exc", [InferenceFailed, ValueError])
async def test_only_the_poison_requests_fail(exc: type[Exception]) -> None:
    engine = FailsOnBrightCorner(exc)
    stage = cpu_stage(ModelConfig(), engine, max_attempts=2)
    try:
        done = await stage.run_batch(Batch(jobs(64, {5, 40}), time.monotonic(), "full"))
    finally:
        stage.close()
    failed = {a.job.offset for a in done.answers if a.error is not None}
    assert failed == {5, 40}
    for a in done.answers:
        if a.error is not None:
            assert a.error.code == "inference_failed" and "after 2 attempts" in a.error.message
        else:
            assert a.outputs is not None and a.outputs["topk_indices"].shape == (3,)
    # Bounded: at most 2n - 1 runs of the bisection plus one retry per poison request.
    assert engine.runs <= 2 * 64 - 1 + 2


async def test_batch_failure_logs_carry_the_batch_context() -> None:
    """Logs of a batch's isolation name the batch they belong to (structlog
    context variables bound per batch), so one poison request can be traced."""
    import structlog
    from structlog.testing import capture_logs

    engine = FailsOnBrightCorner(InferenceFailed)
    stage = cpu_stage(ModelConfig(), engine, max_attempts=1)
    structlog.configure(processors=[structlog.contextvars.merge_contextvars])
    try:
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            await stage.run_batch(Batch(jobs(4, {2}), time.monotonic(), "delay", seq=7))
    finally:
        stage.close()
        structlog.reset_defaults()
    failures = [e for e in logs if e["event"] == "batch_failed"]
    assert failures and all(e["batch"] == 7 and e["flush"] == "delay" for e in failures)
    assert [e["size"] for e in failures] == [4, 2, 1]  # the bisection, down to the poison request


async def test_the_bisection_is_shared_and_runs_any_row_runner() -> None:
    """``run_isolating`` (used by the CPU and GPU stages alike) with a runner that
    fails any run holding the poison request: exactly that request fails, after
    ``max_attempts`` runs alone, and the number of runs stays bounded."""
    answers = [Row.of(job) for job in jobs(8, set())]
    poison = {5}
    runs: list[list[int]] = []

    async def run(part: list[Row]) -> None:
        offsets = [a.job.offset for a in part]
        runs.append(offsets)
        if poison & set(offsets):
            raise InferenceFailed("poisoned batch")
        for a in part:
            a.outputs = {"x": np.zeros(1)}

    labels = {"model": "isolation-test", "version": "7"}
    await run_isolating(answers, run, 2, ModelMetrics(*labels.values()))
    # Counted under the served model's labels (what an operator's alert joins on).
    assert REGISTRY.get_sample_value("infer_isolation_runs_total", labels) == len(runs) - 1
    failed_runs = sum(1 for r in runs if 5 in r)
    assert REGISTRY.get_sample_value("infer_batch_failures_total", labels) == failed_runs
    assert [a.job.offset for a in answers if a.error is not None] == [5]
    assert answers[5].error is not None and "after 2 attempts" in answers[5].error.message
    assert all(a.outputs is not None for a in answers if a.job.offset != 5)
    assert answers[5].attempts == 2
    assert runs[0] == list(range(8))  # the whole batch first
    assert runs.count([5]) == 2  # alone once, then retried once
    assert len(runs) <= 2 * 8 - 1 + 2


async def test_engine_dead_is_not_isolated() -> None:
    """A dead engine stops the bisection at once: nothing can run any more."""
    answers = [Row.of(job) for job in jobs(4, set())]
    calls = 0

    async def run(part: list[Row]) -> None:
        nonlocal calls
        calls += 1
        raise EngineDead("device lost")

    with pytest.raises(EngineDead):
        await run_isolating(answers, run, 3, ModelMetrics("t", "1"))
    assert calls == 1


def test_triage_answers_failed_and_expired_jobs_without_the_engine() -> None:
    now = time.monotonic()
    ok, expired, failed = jobs(3, set())
    expired = msgspec.structs.replace(expired, deadline=now - 1.0)
    failed = msgspec.structs.replace(failed, failure=InvalidRequest("inputs.image: missing"))
    labels = {"model": "triage-test", "version": "1"}
    batch = Batch([ok, expired, failed], now, "delay", seq=3)
    rows, runnable = triage(batch, now, ModelMetrics(*labels.values()))
    completed = answered(batch, rows, len(runnable))
    assert REGISTRY.get_sample_value("infer_queue_seconds_count", labels) == 3
    assert [a.job for a in runnable] == [ok]
    assert completed.seq == 3 and completed.engine_rows == 1
    assert [a.job for a in completed.answers] == [ok, expired, failed]  # batch order kept
    assert completed.answers[1].error is not None
    assert completed.answers[1].error.code == "deadline_exceeded"
    assert completed.answers[2].error is None  # answered from its failure downstream


async def test_a_batch_of_many_lengths_runs_in_one_hand_over_and_isolates_its_poison(
    tmp_path: Path,
) -> None:
    """A batch whose rows have many lengths runs one engine run per length, all
    in one hand-over to the engine's thread; a run that fails is then isolated
    as before: only its poison request fails, every other answer is the model's."""
    from tests.models import jobs_for
    from tests.onnx_models import ranker
    from worker.contract import Tensor

    cfg = ModelConfig(path=str(ranker(tmp_path / "ranker.onnx")))
    inner = load_engine(cfg)
    shapes: list[tuple[int, ...]] = []

    class FailsOnId:
        info = inner.info

        def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            shapes.append(feeds["ids"].shape)
            if (feeds["ids"] == 49).any():
                raise InferenceFailed("poison id")
            return inner.run(feeds)

        def close(self) -> None:
            inner.close()

    stage = cpu_stage(cfg, FailsOnId(), max_attempts=1)
    handovers = 0
    run_each = stage._run_each

    def counted(*args: object) -> object:
        nonlocal handovers
        handovers += 1
        return run_each(*args)  # type: ignore[arg-type]

    stage._run_each = counted  # type: ignore[method-assign]
    rng = np.random.default_rng(3)
    requests = []
    for i in range(24):  # lengths 1..6, four rows each; row 9 (length 4) poisoned
        ids = rng.integers(1, 49, i % 6 + 1).astype(np.int64)
        if i == 9:
            ids[0] = 49
        features = rng.normal(size=4).astype(np.float32)
        requests.append({"features": Tensor.from_numpy(features), "ids": Tensor.from_numpy(ids)})
    try:
        done = await stage.run_batch(Batch(jobs_for(stage.binding.inputs, requests),
                                           time.monotonic(), "full"))  # fmt: skip
    finally:
        stage.close()
    assert handovers == 1  # six runs, one hand-over; isolation runs go one by one
    assert [a.job.offset for a in done.answers if a.error is not None] == [9]
    assert sorted(s[1] for s in shapes[:6]) == [1, 2, 3, 4, 5, 6]  # one run per length
    for answer, given in zip(done.answers, requests, strict=True):
        if answer.job.offset == 9:
            assert answer.error is not None and answer.error.code == "inference_failed"
            continue
        assert answer.outputs is not None
        ids = given["ids"].to_numpy()
        alone = inner.run({"features": given["features"].to_numpy()[None], "ids": ids[None]})
        np.testing.assert_allclose(answer.outputs["score"], alone["score"][0], rtol=1e-6)


async def test_a_request_pinned_to_another_version_is_answered_unknown_model() -> None:
    """``model.version`` is checked where the batch runs, against the version that
    runs it: the pinned-to-it and the unpinned are answered, the other refused."""
    engine = load_engine(ModelConfig())
    version = engine.info.version
    stage = cpu_stage(ModelConfig(), engine)
    pins = [None, ModelRef("digits"), ModelRef("digits", version), ModelRef("digits", "sha256:0")]
    batch = [
        msgspec.structs.replace(
            job, request=Request(v=1, id=f"r{i}", inputs={}, model=pin), model="digits"
        )
        for i, (job, pin) in enumerate(zip(jobs(len(pins), set()), pins, strict=True))
    ]
    try:
        done = await stage.run_batch(Batch(batch, time.monotonic(), "full"))
    finally:
        stage.close()
    assert [a.error is None for a in done.answers] == [True, True, True, False]
    refused = done.answers[3].error
    assert refused is not None and refused.code == "unknown_model"
    assert refused.message == (
        f"model.version: 'sha256:0' is not served; 'digits' serves version {version!r}"
    )
    assert done.engine_rows == 3
