"""Priority lanes on the GPU path (issue 39: one batching policy for both paths).

A worker process with the torch engine and GPU preprocessing drains a bulk
backlog; urgent requests produced behind it are batched long before the bulk
ones waiting in the worker (the lanes' queue-time metrics, as the CPU test in
``tests/faults/test_lanes.py`` reads them), and every request of both lanes is
answered with a result, none lost; a capped bulk lane keeps its rate
(``max_records_per_s``). The embedded broker only: the device
machine has no Java for Apache Kafka."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.conftest import Answers, no_crash_in_log, wait_assigned
from tests.faults.test_lanes import (
    BULK,
    PARTS,
    _backlog,
    by_topic,
    every_request_answered,
    start_with_lanes,
    until,
    urgent_overtakes_bulk,
)
from tests.faults.test_lanes_rate import capped_lane_keeps_its_rate
from worker.ops.broker import Broker

pytestmark = [pytest.mark.gpu, pytest.mark.needs_torch]


def gpu_env(model: Path) -> dict[str, str]:
    """The digits MLP as TorchScript on the GPU, its 8x8 grey input preprocessed there."""
    return {
        "INFER_WORKER_MODEL__BACKEND": "torch",
        "INFER_WORKER_MODEL__PATH": str(model),
        "INFER_WORKER_MODEL__OUTPUT": "logits",
        "INFER_WORKER_MODEL__PREPROCESS__DEVICE": "gpu",
        "INFER_WORKER_MODEL__PREPROCESS__SIZE": "[8, 8]",
        "INFER_WORKER_MODEL__PREPROCESS__CHANNELS": "1",
    }


@pytest.mark.parametrize("broker_kind", ["embedded"])
async def test_urgent_requests_overtake_a_backlog_on_the_gpu(
    broker: Broker, names: dict[str, str], digits_torchscript: Path
) -> None:
    urgent, bulk = await _backlog(broker, names)
    answers = await Answers.start(broker, names)
    w = start_with_lanes(broker, names, **gpu_env(digits_torchscript))
    try:
        await wait_assigned([w], 2 * PARTS, timeout=90)  # torch, the first CUDA graph capture
        waits = await urgent_overtakes_bulk(broker, urgent, w, within=120)
        print(f"mean queue seconds per lane on the GPU path: {waits}")
        await until(lambda: by_topic(answers.collector)[bulk] >= BULK, 120, "backlog answered")
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        w.kill()
        await answers.stop()
    await every_request_answered(broker, names)


@pytest.mark.parametrize("broker_kind", ["embedded"])
async def test_a_capped_lane_keeps_its_rate_on_the_gpu(
    broker: Broker, names: dict[str, str], digits_torchscript: Path
) -> None:
    """``max_records_per_s`` on the GPU path: the same batching policy, so the
    same check as the CPU one (``tests/faults/test_lanes_rate.py``)."""
    await capped_lane_keeps_its_rate(broker, names, False, 90, **gpu_env(digits_torchscript))
