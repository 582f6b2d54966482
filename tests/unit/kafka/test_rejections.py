"""``infer_requests_rejected_total`` is counted in one place, as each answer's
record is made (issue 38): every code a request is refused with without the
model's run, ``too_many_sequences`` included (it was never counted), and
nothing for an answer the model gave or a run that failed."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from prometheus_client import REGISTRY

from tests.unit.kafka.test_stages import A, completed, make_sink
from worker.flow.codes import ErrorCode
from worker.flow.errors import InvalidRequest
from worker.flow.messages import Answer, Job
from worker.flow.offsets import OffsetTracker
from worker.flow.values import ErrorInfo


def rejected(code: str) -> float:
    return REGISTRY.get_sample_value("infer_requests_rejected_total", {"code": code}) or 0.0


async def test_every_refusal_is_counted_once_by_its_code() -> None:
    tracker = OffsetTracker()
    epoch = tracker.track(A, 0, 10)
    for offset in range(1, 5):
        tracker.track(A, offset, 10)

    def job(offset: int, **kw: object) -> Job:
        return Job(A, offset, b"k", time.monotonic(), None, epoch=epoch, **kw)  # type: ignore[arg-type]

    answers = (
        Answer(job(0), error=ErrorInfo(ErrorCode.TOO_MANY_SEQUENCES, "full")),
        Answer(job(1), error=ErrorInfo(ErrorCode.DEADLINE_EXCEEDED, "late")),
        Answer(job(2, failure=InvalidRequest("inputs: bad"))),
        Answer(job(3), error=ErrorInfo(ErrorCode.INFERENCE_FAILED, "the model failed")),
        Answer(job(4), outputs={"y": np.zeros(1, np.float32)}),
    )
    before = {c: rejected(c) for c in ErrorCode}
    sink, _, _ = make_sink(tracker, producer=None)  # type: ignore[arg-type]
    sink._answers.records(completed(*answers).result())
    await asyncio.sleep(0)
    counted = {c: rejected(c) - before[c] for c in ErrorCode if rejected(c) != before[c]}
    assert counted == {
        ErrorCode.TOO_MANY_SEQUENCES: 1, ErrorCode.DEADLINE_EXCEEDED: 1,
        ErrorCode.INVALID_REQUEST: 1,
    }  # fmt: skip
