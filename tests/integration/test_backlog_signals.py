"""The autoscaling signals from a real worker process (issue 68 item 4): a
worker serving two models, a backlog on one model's topic only. Its
``infer_backlog_records`` and ``infer_seconds_to_drain`` rise above 0 while the
other model's read 0, and both go to 0 once the backlog is answered."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import pytest

from tests.integration.test_pipeline import request_bytes
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import produce_all

pytestmark = pytest.mark.integration

_SERIES = re.compile(r'^(infer_backlog_records|infer_seconds_to_drain)\{model="([^"]+)"\} (\S+)$')


def signals(port: int) -> dict[tuple[str, str], float]:
    """Each model's two gauges, by (metric, model), from the raw exposition (the
    test helpers' scrape folds the model label away)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = (_SERIES.match(line) for line in text.splitlines())
    return {(m[1], m[2]): float(m[3]) for m in found if m}


async def wait_for(w: WorkerProcess, what: str, cond: object, timeout: float = 30.0) -> dict:
    assert callable(cond)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        seen = signals(w.metrics_port)
        if cond(seen):
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}; last {signals(w.metrics_port)}\n{w.log_tail()}")


async def test_a_backlog_on_one_model_s_topic_shows_on_it_alone_and_drains_to_0(
    embedded_broker: EmbeddedBroker, names: dict[str, str]
) -> None:
    held, idle = f"{names['requests']}.held", f"{names['requests']}.idle"
    await create_topics(embedded_broker.bootstrap, {held: 1, idle: 1, names["results"]: 1,
                                                    names["dlq"]: 1})  # fmt: skip
    # Produced before the worker starts: 2 full batches of 16 answer at once (the
    # rate is measured on them), the last 8 wait out the queue delay (3 s), a
    # backlog the worker holds while the lag polls (every 0.2 s) report it.
    records = [(f"k{i}".encode(), request_bytes(i)) for i in range(40)]
    await produce_all(embedded_broker.bootstrap, held, records)
    env = {
        "INFER_WORKER_MODELS__HELD__PATH": "builtin:digits",
        "INFER_WORKER_MODELS__HELD__TOPICS": held,
        "INFER_WORKER_MODELS__IDLE__PATH": "builtin:digits",
        "INFER_WORKER_MODELS__IDLE__TOPICS": idle,
        "INFER_WORKER_BATCHING__MAX_BATCH_SIZE": "16",
        "INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS": "3000",
        "INFER_WORKER_METRICS__LAG_INTERVAL_MS": "200",
    }
    w = spawn_worker(embedded_broker.bootstrap, input_topics=[held, idle],
                     output_topic=names["results"], dlq_topic=names["dlq"],
                     group_id=names["group"], extra_env=env)  # fmt: skip
    try:
        await asyncio.to_thread(w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2,
                                60.0, "the assignment of both models' partitions")  # fmt: skip
        busy = await wait_for(
            w, "a backlog on 'held' with its seconds to drain, 0 on 'idle'",
            lambda s: s.get(("infer_seconds_to_drain", "held"), 0) > 0
            and ("infer_backlog_records", "idle") in s,
        )  # fmt: skip
        drained = await wait_for(
            w, "both models drained to 0",
            lambda s: s.get(("infer_backlog_records", "held")) == 0
            and s.get(("infer_seconds_to_drain", "held")) == 0,
        )  # fmt: skip
    finally:
        assert w.terminate() == 0
    assert 0 < busy[("infer_backlog_records", "held")] <= 40
    assert busy[("infer_backlog_records", "idle")] == 0
    assert busy[("infer_seconds_to_drain", "idle")] == 0
    assert drained[("infer_backlog_records", "idle")] == 0
    assert drained[("infer_seconds_to_drain", "idle")] == 0
