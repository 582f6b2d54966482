"""Several models in one worker (``[models.NAME]``) and a pipeline over one of
them (``[pipelines.NAME]``: the digits model, then a function), SIGKILLed
mid-stream and restarted: at-least-once loses nothing on any topic; exactly-once
(Apache Kafka) answers each request once, as read_committed readers see it, the
pipeline's as one answer of the whole pipeline, and each answer names the model
or pipeline its topic belongs to."""

from __future__ import annotations

import asyncio

import pytest

from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import check, read_topics

from .conftest import FAST_GROUP, no_crash_in_log, reads_more, request

pytestmark = pytest.mark.faults

PARTS, N = 2, 1500  # per topic
EOS = {
    "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
    "INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS": "256",
    "INFER_WORKER_KAFKA__MAX_POLL_RECORDS": "100",
}


@pytest.mark.parametrize(
    ("broker_kind", "guarantee"), [("embedded", "at-least-once"), ("kafka", "exactly-once")]
)
async def test_a_sigkill_of_a_two_model_worker(
    broker: Broker, names: dict[str, str], guarantee: str
) -> None:
    first, second = f"{names['requests']}.first", f"{names['requests']}.second"
    third, audit = f"{names['requests']}.third", f"{names['requests']}.audit"
    topics = (first, second, third)
    await create_topics(broker.bootstrap, {**{t: PARTS for t in (*topics, audit)},
                                           names["results"]: PARTS, names["dlq"]: 1})  # fmt: skip
    env = {
        **FAST_GROUP,
        **(EOS if guarantee == "exactly-once" else {}),
        "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "m1",  # the restart takes its partitions back
        "INFER_WORKER_MODEL__PATH": "builtin:digits",  # [model], on the first topic
        "INFER_WORKER_MODELS__SECOND__PATH": "builtin:digits",
        "INFER_WORKER_MODELS__SECOND__TOPICS": second,
        "INFER_WORKER_PIPELINES__CHAIN__TOPICS": third,
        "INFER_WORKER_PIPELINES__CHAIN__STEPS": f'[{{name = "d", model = "digits", topic = '
        f'"{audit}"}}, {{name = "f", '
        'function = "tests.pipeline_functions:doubled", inputs = {x = "d.topk_scores"}, '
        'outputs = {y = "float32 [3]"}}]',
        "INFER_WORKER_PIPELINES__CHAIN__OUTPUTS": '{scores = "f.y", classes = "d.topk_indices"}',
    }

    def worker() -> WorkerProcess:
        return spawn_worker(broker.bootstrap, input_topics=list(topics),
                            output_topic=names["results"], dlq_topic=names["dlq"],
                            group_id=names["group"], extra_env=env)  # fmt: skip

    isolation = "read_committed" if guarantee == "exactly-once" else "read_uncommitted"
    w = worker()
    killed: WorkerProcess | None = None
    try:
        await asyncio.to_thread(w.wait_until, lambda m: m.get("infer_assigned_partitions", 0)
                                >= 3 * PARTS, 90.0, "assignment")  # fmt: skip
        producing = asyncio.gather(*(
            produce_all(broker.bootstrap, t, [(None, request(i)) for i in range(N)],
                        partition_of=lambda i: i % PARTS, rate=300)
            for t in topics
        ))  # fmt: skip
        await reads_more(w, N // 2, within=30.0)  # mid-stream: both models have work in flight
        w.kill()
        killed, w = w, worker()
        await producing
        c = Collector(broker.bootstrap, [names["results"], audit], isolation_level=isolation)
        await c.start()
        try:
            distinct = lambda c: len({(r.result().source.topic, r.result().source.offset,  # noqa: E731
                                       r.result().source.partition)
                                      for r in c.records.get(names["results"], [])})  # fmt: skip
            done = await c.collect(lambda c: distinct(c) >= 3 * N and len(
                c.records.get(audit, [])) >= N, 180.0)  # fmt: skip
            assert done, f"{distinct(c)} of {3 * N} answered\n{w.log_tail()}"
        finally:
            await c.stop()
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        for p in (w, killed):
            if p is not None:
                p.kill()
    by_model = {first: "digits", second: "second", third: "chain"}
    for r in c.records[names["results"]]:
        result = r.result()
        assert (result.status, result.model.name) == ("ok", by_model[result.source.topic])
        if result.source.topic == third:
            assert set(result.outputs) == {"scores", "classes"}
    # The pipeline's first step on its own topic: every request's, once under exactly-once.
    audited = [r.result().source for r in c.records[audit]]
    assert len(set(audited)) == N, len(set(audited))
    if guarantee == "exactly-once":
        assert len(audited) == N, f"{len(audited) - N} written twice"
    inputs, seen = await read_topics(broker.bootstrap, list(topics), names["results"],
                                     names["dlq"], idle_timeout=1.5,
                                     isolation_level=isolation)  # fmt: skip
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable,
                   strict=guarantee == "exactly-once")  # fmt: skip
    assert report.totals.requests == 3 * N and report.totals.lost == 0, report.format()
    if guarantee == "exactly-once":
        assert report.totals.surplus_answers == 0 and report.ok, report.format()
