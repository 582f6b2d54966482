"""A stateful model's states survive a SIGKILL (issue 28), on Apache Kafka,
exactly-once: two workers serve silero-vad streams (the record key is the
stream) with a state changelog (``kafka.state_topic``); one is SIGKILLed
mid-stream, the other takes its partition over and restores its streams' states
from the changelog. A read_committed reader sees every chunk answered once, and
every answer equals the model file run on its stream alone, its state threaded
from chunk to chunk, across the kill."""

from __future__ import annotations

import pytest

from tests import real_models
from tests.integration.test_stateful import (
    CHUNKS,
    STATEFUL,
    assert_as_alone,
    audio,
    chunk_request,
)
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import check, read_topics

from .conftest import no_crash_in_log, start, wait_assigned

pytestmark = pytest.mark.faults

STREAMS, PARTS = 8, 2


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_states_restored_after_a_sigkill_answer_as_the_stream_alone(
    broker: Broker, names: dict[str, str]
) -> None:
    states = f"{names['requests']}.states"
    await create_topics(broker.bootstrap, {names["requests"]: PARTS, names["results"]: PARTS,
                                           names["dlq"]: 1, states: PARTS})  # fmt: skip
    env = {
        **STATEFUL,
        "INFER_WORKER_MODEL__PATH": str(real_models.model_path("silero-vad")),
        "INFER_WORKER_KAFKA__STATE_TOPIC": states,
        "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
        # The killed member's open transaction is aborted this soon, so that
        # read_committed readers of its partitions are not held up for long.
        "INFER_WORKER_KAFKA__TRANSACTION_TIMEOUT_MS": "4000",
        "INFER_WORKER_BATCHING__MAX_QUEUE_DELAY_MS": "20",
    }

    def worker(member: str) -> WorkerProcess:
        return start(broker, names, INFER_WORKER_KAFKA__GROUP_INSTANCE_ID=member, **env)

    streams = {s: audio(s) for s in range(STREAMS)}
    records = [
        (f"stream-{s}".encode(), chunk_request(s, i, streams[s][i]))
        for i in range(CHUNKS) for s in range(STREAMS)
    ]  # fmt: skip
    part_of = {f"stream-{s}".encode(): s % PARTS for s in range(STREAMS)}
    w1, w2 = worker("w1"), worker("w2")
    results = Collector(broker.bootstrap, [names["results"]], isolation_level="read_committed")
    await results.start()
    try:
        await wait_assigned([w1, w2], PARTS)
        half = len(records) // 2
        await produce_all(broker.bootstrap, names["requests"], records[:half],
                          partition_of=lambda i: part_of[records[i][0]])  # fmt: skip
        assert await results.collect(lambda c: c.count() >= half, 60.0), w1.log_tail()
        w1.kill()  # its streams' states now live only in the changelog
        rest = records[half:]
        await produce_all(broker.bootstrap, names["requests"], rest,
                          partition_of=lambda i: part_of[rest[i][0]])  # fmt: skip
        done = await results.collect(lambda c: c.count() >= len(records), 120.0)
        assert done, f"{results.count()} of {len(records)}\n{w2.log_tail()}"
        m = w2.metrics()
        assert w2.terminate() == 0, w2.log_tail()
        no_crash_in_log(w2)
    finally:
        w1.kill()
        w2.kill()
        await results.stop()
    assert m.get("infer_restored_sequences_total", 0) >= 1, "w2 restored nothing"
    inputs, seen = await read_topics(broker.bootstrap, [names["requests"]], names["results"],
                                     names["dlq"], idle_timeout=1.5,
                                     isolation_level="read_committed")  # fmt: skip
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable, strict=True)
    assert report.totals.requests == len(records) and report.ok, report.format()
    answers = {r.result().id: r.result() for r in results.records[names["results"]]}
    assert_as_alone(answers, streams)
