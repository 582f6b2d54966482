"""A stateful model's states survive a SIGKILL (issue 28), on Apache Kafka: two
workers serve silero-vad streams (the record key is the stream) with a state
changelog (``kafka.state_topic``); one is SIGKILLed mid-stream, the other takes
its partition over and restores its streams' states from the changelog.

Exactly-once: a read_committed reader sees every chunk answered once, and every
answer equals the model file run on its stream alone, its state threaded from
chunk to chunk, across the kill. At-least-once: nothing is lost; requests the
killed worker answered but had not committed are answered again against a
state that already includes them, so some answers differ from the stream run
alone: counted and reported (FAULT_REPORT), as docs/guides/stateful.md says."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.integration.test_stateful import (
    CHUNKS,
    assert_as_alone,
    audio,
    chunk_request,
    sequential_reference,
)
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import check, read_topics

from .conftest import (
    no_crash_in_log,
    record_scenario,
    silero_with_changelog,
    start,
    wait_assigned,
)

pytestmark = pytest.mark.faults

STREAMS, PARTS = 8, 2


@pytest.mark.parametrize(("guarantee", "beside"), [
    ("exactly-once", False), ("at-least-once", False), ("exactly-once", True)],
    ids=["exactly-once", "at-least-once", "exactly-once-beside-another-model"])  # fmt: skip
@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_states_restored_after_a_sigkill(
    broker: Broker, names: dict[str, str], guarantee: str, beside: bool
) -> None:
    """``beside``: silero-vad is a [models.NAME] with a changelog of its own
    (models.vad.state_topic) beside the digits model on a topic of its own
    (issue 64: durable states were refused with several models)."""
    eos = guarantee == "exactly-once"
    served = await silero_with_changelog(broker, names, PARTS)
    if beside:
        other = f"{names['requests']}.other"
        await create_topics(broker.bootstrap, {other: 1})
        served = {k.replace("INFER_WORKER_MODEL__", "INFER_WORKER_MODELS__VAD__"): v
                  for k, v in served.items()}  # fmt: skip
        changelog = served.pop("INFER_WORKER_KAFKA__STATE_TOPIC")
        served["INFER_WORKER_MODELS__VAD__STATE_TOPIC"] = changelog
        served |= {"INFER_WORKER_MODELS__VAD__TOPICS": names["requests"],
                   "INFER_WORKER_MODELS__DIGITS__PATH": "builtin:digits",
                   "INFER_WORKER_MODELS__DIGITS__TOPICS": other,
                   "INFER_WORKER_KAFKA__INPUT_TOPICS": f"{names['requests']},{other}"}
    env = {
        **served,
        "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": guarantee,
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
    isolation = "read_committed" if eos else "read_uncommitted"
    results = Collector(broker.bootstrap, [names["results"]], isolation_level=isolation)
    await results.start()
    answered = lambda c: len({r.result().id for r in c.records[names["results"]]})  # noqa: E731
    try:
        await wait_assigned([w1, w2], PARTS + int(beside))  # the other model: 1 more
        producing = asyncio.create_task(produce_all(
            broker.bootstrap, names["requests"], records,
            partition_of=lambda i: part_of[records[i][0]], rate=40,
        ))  # fmt: skip
        assert await results.collect(lambda c: answered(c) >= len(records) // 3, 60.0)
        w1.kill()  # mid-stream: its streams' states now live only in the changelog
        await producing
        done = await results.collect(lambda c: answered(c) >= len(records), 120.0)
        assert done, f"{answered(results)} of {len(records)}\n{w2.log_tail()}"
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
                                     isolation_level=isolation)  # fmt: skip
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable, strict=eos)
    assert report.totals.requests == len(records) and report.ok, report.format()
    if eos:
        answers = {r.result().id: r.result() for r in results.records[names["results"]]}
        assert_as_alone(answers, streams)
        return
    differ = 0
    for s, chunks in streams.items():
        for i, want in enumerate(sequential_reference(chunks)):
            got = [r.result() for r in results.records[names["results"]]
                   if r.result().id == f"s{s}-c{i}"]  # fmt: skip
            differ += any(
                not np.allclose(g.outputs["output"].to_numpy(), want, rtol=1e-4, atol=1e-5)
                for g in got
            )
    record_scenario(
        "stateful, at-least-once: SIGKILL, states restored (silero-vad, 8 streams x 5)",
        report, None, answers_differing_from_alone=differ,
        duplicated=report.totals.surplus_answers,
    )  # fmt: skip
    print(f"at-least-once: {differ} of {len(records)} answers differ from the stream alone")
