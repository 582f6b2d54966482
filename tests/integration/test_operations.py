"""What an operator scrapes and probes (issue 13), from a real worker process."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest

from tests.integration.test_pipeline import collect, request_bytes, start_worker
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import produce_all

pytestmark = pytest.mark.integration


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def exposition(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


async def test_probes_build_info_and_latency_histograms(
    broker: Broker, names: dict[str, str]
) -> None:
    topics = {names["requests"]: 2, names["results"]: 1, names["dlq"]: 1}
    await create_topics(broker.bootstrap, topics)
    # Static membership and pass-through client options: the worker must join
    # and work with them.
    w = await start_worker(
        broker,
        names,
        2,
        INFER_WORKER_KAFKA__GROUP_INSTANCE_ID="pod-0",
        INFER_WORKER_KAFKA__CONSUMER_OPTIONS__ISOLATION_LEVEL="read_committed",
        INFER_WORKER_KAFKA__PRODUCER_OPTIONS__CONNECTIONS_MAX_IDLE_MS="60000",
    )
    try:
        records = [(f"k{i}".encode(), request_bytes(i)) for i in range(50)]
        await produce_all(broker.bootstrap, names["requests"], records)
        await collect(broker, [names["results"]], 50)
        m = w.wait_until(lambda m: m.get("infer_record_age_seconds_count", 0) >= 50, 30.0, "acks")
        lag = w.wait_until(
            lambda m: (
                sum(1 for k in m if k.startswith("infer_partition_lag_records{")) == 2
                and sum(v for k, v in m.items() if k.startswith("infer_partition_lag_records{"))
                == 0
            ),
            30.0,
            "per-partition lag of 0 on both partitions",
        )
        # The event loop's timer, ten times a second: how late it came. Waited
        # for, not read once: a fast run may scrape before five ticks.
        ticks = w.wait_until(
            lambda m: m.get("infer_event_loop_lag_seconds_count", 0) >= 5, 30.0, "loop-lag ticks"
        )
        probes = {p: status(w.metrics_port, p) for p in ("/livez", "/healthz", "/readyz", "/ready")}
        raw = exposition(w.metrics_port)
    finally:
        assert w.terminate() == 0
    assert probes == {"/livez": 200, "/healthz": 200, "/readyz": 200, "/ready": 200}
    info = [k for k in m if k.startswith("infer_build_info{")]
    assert len(info) == 1 and m[info[0]] == 1.0
    assert 'model="digits"' in info[0] and 'backend="onnxruntime"' in info[0]
    assert 'device="cpu"' in info[0] and 'model_version="' in info[0]
    assert m["infer_queue_seconds_count"] == 50
    # Inference metrics carry the served model's name and version (the scrape
    # above folds them away, as one process serves one model).
    for series in ("infer_queue_seconds_count", "infer_batch_size_count", "infer_batches_total"):
        assert re.search(series + r'\{model="digits",(.*,)?version="[^"]+"', raw), series
    ok = r'infer_results_produced_total\{model="digits",status="ok",version="[^"]+"\} 50'
    assert re.search(ok, raw)
    # Buckets start at 100 us, so fast batches are not all in the first one.
    assert 'infer_engine_seconds_bucket{le="0.0001"}' in m
    assert (
        ticks['infer_event_loop_lag_seconds_bucket{le="+Inf"}']
        == ticks["infer_event_loop_lag_seconds_count"]
    )
    assert lag['infer_rebalances_total{kind="assigned"}'] >= 1
    ages = [v for k, v in lag.items() if k.startswith("infer_partition_last_commit_age_seconds{")]
    assert len(ages) == 2 and all(0 <= a < 60 for a in ages)


async def test_async_client_request_response_with_many_calls_in_flight(
    broker: Broker, names: dict[str, str]
) -> None:
    """``worker.client.InferenceClient``: concurrent calls each get their own
    answer; a call nobody answers times out."""
    import asyncio

    from tests.images import encode
    from worker.bench.demo import labelled_samples
    from worker.client import InferenceClient

    await create_topics(
        broker.bootstrap, {names["requests"]: 2, names["results"]: 2, names["dlq"]: 1}
    )
    samples = labelled_samples(1)[:20]
    async with InferenceClient(
        broker.bootstrap, input_topic=names["requests"], output_topic=names["results"]
    ) as client:
        with pytest.raises(TimeoutError):  # no worker yet
            await client.infer(samples[0].image, timeout=0.5)
        w = await start_worker(broker, names, 2)
        try:
            calls = [client.infer(s.image, timeout=30) for s in samples[:10]]
            calls += [client.infer(encode(s.image, "PNG"), timeout=30) for s in samples[10:]]
            results = await asyncio.gather(*calls)
        finally:
            assert w.terminate() == 0
    assert len({r.id for r in results}) == 20
    assert all(r.status == "ok" for r in results), [r.error for r in results]
    # Each call got its own image's answer: the model (97.5% accurate) names the
    # labels of nearly all these digits.
    assert (
        sum(
            int(r.outputs["topk_indices"].to_numpy()[0]) == s.label
            for s, r in zip(samples, results, strict=True)
        )
        >= 18
    )
