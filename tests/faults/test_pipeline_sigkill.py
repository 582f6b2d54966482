"""A pipeline of real models (openWakeWord's melspectrogram, the window function,
its embedding model: ``tests/integration/test_pipelines.py``) SIGKILLed
mid-stream under exactly-once and restarted (Apache Kafka): every request is
answered once, as read_committed readers see it, each answer equal to the files
run by hand, and the first step's records on its own topic are written once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_pipelines import WITH_MEL, by_hand
from tests.serving import wire
from tests.wakeword import wakeword_toml
from worker.contract import Tensor
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import check, read_topics

from .conftest import FAST_GROUP, no_crash_in_log, reads_more

pytestmark = pytest.mark.faults

PARTS, N = 2, 240
EOS = {
    "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
    "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "p1",  # the restart takes its partitions back
    "INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS": "64",
}


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_a_sigkill_of_a_pipeline_answers_every_request_once(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topic, mel_topic = names["requests"], f"{names['requests']}.mel"
    config = tmp_path / "worker.toml"
    config.write_text(wakeword_toml(topic, outputs=WITH_MEL, mel_topic=mel_topic))
    await create_topics(broker.bootstrap, {topic: PARTS, mel_topic: PARTS,
                                           names["results"]: PARTS, names["dlq"]: 1})  # fmt: skip
    rng = np.random.default_rng(60)
    audio = {f"a-{i}": rng.normal(0, 3000, 13000).astype(np.float32) for i in range(N)}
    records = [(rid.encode(), wire(rid, {"input": Tensor.from_numpy(a)}))
               for rid, a in audio.items()]  # fmt: skip

    def worker() -> WorkerProcess:
        return spawn_worker(broker.bootstrap, input_topics=[topic],
                            output_topic=names["results"], dlq_topic=names["dlq"],
                            group_id=names["group"], command=("run", "--config", str(config)),
                            extra_env={**FAST_GROUP, **EOS})  # fmt: skip

    w = worker()
    killed: WorkerProcess | None = None
    try:
        await asyncio.to_thread(w.wait_until, lambda m: m.get("infer_assigned_partitions", 0)
                                >= PARTS, 90.0, "assignment")  # fmt: skip
        producing = asyncio.ensure_future(produce_all(
            broker.bootstrap, topic, records, partition_of=lambda i: i % PARTS, rate=40))
        await reads_more(w, N // 2, within=30.0)  # mid-stream
        w.kill()
        killed, w = w, worker()
        await producing
        c = Collector(broker.bootstrap, [names["results"], mel_topic],
                      isolation_level="read_committed")  # fmt: skip
        await c.start()
        try:
            # The mel step's records commit with the answers, but may be fetched after them.
            done = await c.collect(lambda c: len({r.record_key for r in c.records.get(
                names["results"], [])}) >= N and len(c.records.get(mel_topic, [])) >= N,
                180.0)  # fmt: skip
            await c.collect(lambda c: False, 1.0)  # and nothing more: each once
            assert done, w.log_tail()
        finally:
            await c.stop()
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        for p in (w, killed):
            if p is not None:
                p.kill()
    answers = [r.result() for r in c.records[names["results"]]]
    assert len(answers) == N, f"{len(answers) - N} answered twice"
    for r in answers:
        assert (r.status, r.model.name) == ("ok", "wakeword"), r.error
        want = by_hand(audio[r.id])["embedding"]
        np.testing.assert_allclose(r.outputs["embedding"].to_numpy(), want, rtol=1e-4, atol=1e-4)
    assert len(c.records[mel_topic]) == N, "the mel step's records: each once"
    inputs, seen = await read_topics(broker.bootstrap, [topic], names["results"],
                                     names["dlq"], idle_timeout=1.5,
                                     isolation_level="read_committed")  # fmt: skip
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable, strict=True)
    assert report.totals.requests == N and report.totals.lost == 0, report.format()
    assert report.totals.surplus_answers == 0 and report.ok, report.format()
