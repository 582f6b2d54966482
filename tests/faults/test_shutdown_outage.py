"""SIGTERM while the broker is down (issue 10): the worker still exits within
``shutdown.drain_timeout_ms`` plus a small margin, commits nothing it did not
deliver, and says what it abandoned."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from tests.faults.conftest import request, start, wait_assigned
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import produce_all

DRAIN_MS = 2000
MARGIN_S = 3.0  # process exit, interpreter shutdown, closing sockets


async def test_sigterm_during_a_broker_outage_exits_within_the_drain_deadline(
    names: dict[str, str], broker_factory: Callable[[], Broker]
) -> None:
    topics = {names["requests"]: 2, names["results"]: 2, names["dlq"]: 1}
    broker = broker_factory()
    await create_topics(broker.bootstrap, topics)
    w = start(
        broker,
        names,
        INFER_WORKER_SHUTDOWN__DRAIN_TIMEOUT_MS=str(DRAIN_MS),
        INFER_WORKER_KAFKA__REQUEST_TIMEOUT_MS="30000",
        # Slow the engine's batches down so work is in flight when the broker goes.
        INFER_WORKER_BATCHING__MAX_BATCH_SIZE="1",
        INFER_WORKER_BATCHING__MAX_INFLIGHT_BATCHES="1",
    )
    try:
        await wait_assigned([w], 2)
        await produce_all(
            broker.bootstrap, names["requests"], [(None, request(i)) for i in range(20000)]
        )
        await asyncio.sleep(0.3)  # mid-stream
        broker.stop()
        await asyncio.sleep(1.0)  # acks now fail; the worker redelivers
        t0 = time.monotonic()
        code = await asyncio.to_thread(w.terminate, 60.0)
        took = time.monotonic() - t0
    finally:
        w.kill()
        broker.stop()
    log = [json.loads(x) for x in w.log_tail(2000).splitlines() if x.startswith("{")]
    stopped = [e for e in log if e.get("event") == "worker_stopped"]
    events = "\n".join(f"{e.get('timestamp', '')[11:23]} {e.get('event')}" for e in log[-60:])
    abandoned = stopped[-1]["abandoned"] if stopped else None
    print(f"exit took {took:.2f}s, abandoned {abandoned}")
    assert took <= DRAIN_MS / 1000 + MARGIN_S, f"exit took {took:.1f}s\n{events}"
    assert code == 2, w.log_tail()  # did not drain: exit 2, as documented
    assert stopped and stopped[-1]["drained"] is False
    assert stopped[-1]["abandoned"] > 0 and stopped[-1]["uncommitted"] > 0
