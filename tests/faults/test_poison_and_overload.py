"""A model that fails on one input, and input arriving faster than inference."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from worker.ops.broker import Broker, create_topics
from worker.ops.topics import produce_all

from .conftest import (
    Answers,
    no_crash_in_log,
    record_scenario,
    request,
    start,
    verify_topics,
    wait_assigned,
)
from .poison_model import build

pytestmark = pytest.mark.faults


async def test_only_the_poison_request_fails(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    model = build(tmp_path / "poison.onnx")
    n, poison = 400, {37, 200, 351}
    await create_topics(
        broker.bootstrap, {names["requests"]: 2, names["results"]: 2, names["dlq"]: 1}
    )
    await produce_all(
        broker.bootstrap,
        names["requests"],
        [(None, request(i, corner=255 if i in poison else None)) for i in range(n)],
        partition_of=lambda i: i % 2,
    )
    answers = await Answers.start(broker, names)
    # The requests are images: model.input asks for the image shorthand (what an
    # unnamed input is otherwise: a tensor), its settings taken from the model.
    w = start(
        broker, names, INFER_WORKER_MODEL__PATH=str(model), INFER_WORKER_MODEL__NAME="poisoned",
        INFER_WORKER_MODEL__INPUT="image",
    )  # fmt: skip
    try:
        await wait_assigned([w], 2)
        await answers.wait_for(n, 60)
        metrics = w.metrics()
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        w.kill()
        await answers.stop()
    results = [r.result() for r in answers.collector.records[names["results"]]]
    failed = {int(r.id.split("-")[1]) for r in results if r.status == "error"}
    assert failed == poison
    for r in results:
        if r.status == "error":
            assert r.error is not None and r.error.code == "inference_failed"
            assert "Reshape" in r.error.message
    assert sum(r.status == "ok" for r in results) == n - len(poison)
    assert metrics["infer_isolation_runs_total"] > 0
    assert metrics['infer_results_produced_total{status="error"}'] == len(poison)
    report = await verify_topics(broker, names, seen=answers)
    record_scenario(
        "model fails on 3 of 400 requests",
        report,
        None,
        isolation_runs=metrics["infer_isolation_runs_total"],
    )
    assert report.totals.lost == 0


async def test_input_faster_than_inference_pauses_and_stays_bounded(
    broker: Broker, names: dict[str, str]
) -> None:
    n, bound, poll = 600, 64, 20
    await create_topics(
        broker.bootstrap, {names["requests"]: 2, names["results"]: 2, names["dlq"]: 1}
    )
    # Everything is in the topic before the worker starts: fetching is far
    # faster than one batch of 8 at a time through the engine.
    await produce_all(
        broker.bootstrap,
        names["requests"],
        [(None, request(i, size=96)) for i in range(n)],
        partition_of=lambda i: i % 2,
    )
    answers = await Answers.start(broker, names)
    w = start(
        broker,
        names,
        INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS=str(bound),
        INFER_WORKER_BATCHING__MAX_BATCH_SIZE="8",
        INFER_WORKER_BATCHING__PREFERRED_BATCH_SIZES="[8]",
        INFER_WORKER_BATCHING__MAX_INFLIGHT_BATCHES="1",
        INFER_WORKER_KAFKA__MAX_POLL_RECORDS=str(poll),
    )
    peak = {"records": 0.0}
    done = threading.Event()

    def sample() -> None:  # the worker's own gauge, read while it runs
        while not done.is_set():
            try:
                m = w.metrics()
            except OSError:
                continue
            peak["records"] = max(peak["records"], m.get("infer_inflight_records", 0.0))

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        await wait_assigned([w], 2)
        sampler.start()
        await answers.wait_for(n, 120)
        done.set()
        metrics = w.metrics()
        assert w.terminate() == 0, w.log_tail()
    finally:
        done.set()
        w.kill()
        await answers.stop()
    await asyncio.to_thread(sampler.join, 5)
    assert metrics["infer_partition_pauses_total"] >= 1
    assert metrics["infer_partition_resumes_total"] >= 1
    # Paused at the bound; one fetch of max_poll_records may land after it.
    assert 0 < peak["records"] <= bound + poll, peak
    report = await verify_topics(broker, names, seen=answers)
    record_scenario(
        "input faster than inference (bound 64 records)",
        report,
        None,
        pauses=metrics["infer_partition_pauses_total"],
        peak_inflight=peak["records"],
    )
    assert report.totals.lost == 0 and report.totals.surplus_answers == 0
