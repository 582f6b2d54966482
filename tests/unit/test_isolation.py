"""Poison isolation in the CPU inference stage: a batch that fails is split until
the failing request is alone; everything else in it is answered normally."""

from __future__ import annotations

import time

import numpy as np
import pytest

from worker.batching import Batch
from worker.commit import TopicPartition
from worker.config import ModelConfig
from worker.consume import Job
from worker.engines import EngineInfo, load_engine
from worker.errors import InferenceFailed
from worker.infer import InferenceStage


class FailsOnBrightCorner:
    """The real bundled model, plus a failure for any batch holding an image whose
    top-left value is high (as a data-dependent model bug would)."""

    def __init__(self, exc: type[Exception]) -> None:
        self._inner = load_engine(ModelConfig())
        self.info: EngineInfo = self._inner.info
        self._exc = exc
        self.runs = 0

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        self.runs += 1
        if (batch[:, 0, 0, 0] > 0.9).any():
            raise self._exc("bright corner")
        return self._inner.run(batch)

    def close(self) -> None:
        self._inner.close()


def jobs(n: int, poison: set[int]) -> list[Job]:
    out = []
    for i in range(n):
        img = np.zeros((8, 8, 1), np.uint8)
        if i in poison:
            img[0, 0, 0] = 255
        out.append(Job(TopicPartition("in", 0), i, None, time.monotonic(), None, image=img))
    return out


@pytest.mark.parametrize("exc", [InferenceFailed, ValueError])
def test_only_the_poison_requests_fail(exc: type[Exception]) -> None:
    engine = FailsOnBrightCorner(exc)
    stage = InferenceStage(None, None, engine, ModelConfig(), 64, 1, max_attempts=2)  # type: ignore[arg-type]
    try:
        done = stage._run_batch(Batch(jobs(64, {5, 40}), time.monotonic(), "full"))
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


def test_batch_failure_logs_carry_the_batch_context() -> None:
    """Logs from the worker thread name the batch they belong to (structlog
    context variables bound per batch), so one poison request can be traced."""
    import structlog
    from structlog.testing import capture_logs

    engine = FailsOnBrightCorner(InferenceFailed)
    stage = InferenceStage(None, None, engine, ModelConfig(), 64, 1, max_attempts=1)  # type: ignore[arg-type]
    structlog.configure(processors=[structlog.contextvars.merge_contextvars])
    try:
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            stage._run_batch(Batch(jobs(4, {2}), time.monotonic(), "delay", seq=7))
    finally:
        stage.close()
        structlog.reset_defaults()
    failures = [e for e in logs if e["event"] == "batch_failed"]
    assert failures and all(e["batch"] == 7 and e["flush"] == "delay" for e in failures)
    assert [e["size"] for e in failures] == [4, 2, 1]  # the bisection, down to the poison request
