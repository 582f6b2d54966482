"""The results producer is idempotent where the broker has it (Apache Kafka) and
falls back, with a warning, where it does not (the embedded broker); on Kafka a
result refused for good does not stall its partition."""

from __future__ import annotations

import json

import numpy as np
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests.integration.test_pipeline import collect, start_worker
from worker.contract import Request, Tensor, encode_request
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess
from worker.ops.topics import committed_offsets, produce_all
from worker.ops.verify import check, read_topics

pytestmark = pytest.mark.integration


def events(w: WorkerProcess) -> list[dict[str, object]]:
    with open(w.log_path, errors="replace") as fh:
        return [json.loads(line) for line in fh if line.startswith("{")]


def request(i: int, pad: int = 0) -> bytes:
    img = np.random.default_rng(i).integers(0, 256, (8, 8, 1), dtype=np.uint8)
    # ``meta`` (up to limits' 4 KiB) is echoed in the result: padding it makes it large.
    meta = {"pad": "y" * pad} if pad else {"i": i}
    return encode_request(
        Request(v=1, id=f"req-{i}", inputs={"image": Tensor.from_numpy(img)}, meta=meta)
    )


async def test_idempotent_where_the_broker_supports_it_else_a_warned_fallback(
    broker: Broker, names: dict[str, str]
) -> None:
    n = 40
    await create_topics(
        broker.bootstrap, {names["requests"]: 2, names["results"]: 2, names["dlq"]: 1}
    )
    w = await start_worker(broker, names, 2)
    try:
        await produce_all(
            broker.bootstrap, names["requests"], [(None, request(i)) for i in range(n)]
        )
        c = await collect(broker, [names["results"]], n)
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
    assert {r.result().status for r in c.records[names["results"]]} == {"ok"}
    log = events(w)
    (started,) = [e for e in log if e.get("event") == "producer_started"]
    warned = [e for e in log if e.get("event") == "idempotence_unavailable"]
    # Kafka grants a producer id; the embedded broker refuses InitProducerId.
    assert started["idempotent"] is broker.supports_transactions, started
    assert bool(warned) is not broker.supports_transactions, warned


@pytest.mark.parametrize("broker_kind", ["kafka"])
@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
@pytest.mark.parametrize("batch", ["1", "8"])
async def test_a_result_refused_for_good_does_not_stall_its_partition(
    broker: Broker, names: dict[str, str], guarantee: str, batch: str
) -> None:
    """The results topic takes record batches up to 2 KiB; every fifth request
    asks for a ~4 KiB result. The broker refuses those for good, and with them
    (aiokafka does not renumber an idempotent producer's batches) every later
    batch of the partition as out of order. The worker answers the large ones
    ``too_large`` and re-sends the rest through a new producer: every request is
    answered once, in order, and committed. Exactly-once does it by aborting the
    transaction and sending it again (the records one per record batch, then
    with the refused one's fallback): a read_committed reader sees each once."""
    n = 30
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(names["results"], 1, 1, topic_configs={"max.message.bytes": "2048"})]
        )
    finally:
        await admin.close()
    await create_topics(
        broker.bootstrap, {names["requests"]: 1, names["results"]: 1, names["dlq"]: 1}
    )
    large = {i for i in range(n) if i % 5 == 4}
    await produce_all(
        broker.bootstrap,
        names["requests"],
        [(None, request(i, pad=3500 if i in large else 0)) for i in range(n)],
    )
    env = {"INFER_WORKER_BATCHING__MAX_BATCH_SIZE": batch}
    if guarantee == "exactly-once":
        env |= {
            "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": guarantee,
            "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "w1",
        }
    w = await start_worker(broker, names, 1, **env)
    try:
        c = await collect(broker, [names["results"]], n, isolation_level="read_committed")
        assert w.proc.poll() is None, w.log_tail()
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()
    results = [r.result() for r in c.records[names["results"]]]
    codes = {int(r.source.offset): (r.error.code if r.error else r.status) for r in results}
    assert codes == {i: "too_large" if i in large else "ok" for i in range(n)}, codes
    assert [r.source.offset for r in results] == sorted(r.source.offset for r in results)
    log = events(w)
    assert any(e.get("event") == "producer_renewed" for e in log), w.log_tail()
    if guarantee == "exactly-once":
        assert any(e.get("event") == "transaction_aborted" for e in log), w.log_tail()
    assert await committed_offsets(broker.bootstrap, names["group"], names["requests"], 1) == {0: n}
    inputs, observed = await read_topics(
        broker.bootstrap,
        [names["requests"]],
        names["results"],
        names["dlq"],
        idle_timeout=1.0,
        isolation_level="read_committed",
    )
    report = check(inputs, observed.answers, unparseable=observed.unparseable, strict=True)
    assert report.ok, report.format()
