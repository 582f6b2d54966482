"""A model that comes while two members serve under load, on Apache Kafka
(``worker.app.arrivals``, issue 68), exactly-once and at-least-once.

Two static members of one group serve the repository's model ``a``
(``repository.models = ["a"]``) with ``kafka.processing_guarantee =
"exactly-once"`` while a steady stream of requests comes to ``a``'s topic, and
another to ``b``'s topic, which no member reads yet. ``infer-worker models load
b --version 1`` (``b`` copied into the repository after the members started)
brings ``b`` on both members: each grows its subscription, a rebalance in which
``a``'s partitions are revoked and settled mid-stream. A read_committed reader
then sees every request of both topics answered once, none lost, none twice
(at-least-once as well: a clean hand-over answers nothing twice)
(``b``'s backlog from before the record too), each answer equal to its model
run alone, and ``b``'s partitions shared by both members.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from tests.onnx_models import tabular
from worker.contract import Result
from worker.model.files import content_version
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector

from .conftest import FAST_GROUP, no_crash_in_log, wait_assigned
from .test_exactly_once import EOS, until
from .test_models_demand_eos import (
    COMPACTED,
    _cli,
    _equal_alone,
    _exactly_once,
    _features,
    _streams,
)

pytestmark = pytest.mark.faults
pytest.importorskip("onnx")

PARTS = 2
CAP, RATE = 2000, 100.0  # requests per topic at most, and per second to each


@pytest.mark.parametrize("broker_kind", ["kafka"])
@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
async def test_a_model_brought_under_load_answers_every_request_exactly_once(
    broker: Broker, names: dict[str, str], tmp_path: Path, guarantee: str
) -> None:
    """At-least-once too: the members' partitions are settled and committed
    while still assigned before the subscription grows (aiokafka drops them at
    once), so none is answered twice (before that was so, 17 of 2,860 were in
    a benchmark run)."""
    topics = {m: f"{names['requests']}.{m}" for m in ("a", "b")}
    ctl = f"{names['requests']}.control"
    await create_topics(broker.bootstrap, {**{t: PARTS for t in topics.values()},
                                           names["results"]: PARTS, names["dlq"]: 1, ctl: 1},
                        {ctl: COMPACTED})  # fmt: skip
    repo = tmp_path / "models"
    files: dict[str, Path] = {}

    def copy_in(name: str, seed: int) -> None:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "model.toml").write_text(f'topics = ["{topics[name]}"]\n')
        files[name] = tabular(repo / name / "1" / "model.onnx", seed=seed)

    copy_in("a", 1)
    config = tmp_path / "worker.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
                      f'input_topics = ["{topics["a"]}"]\ncontrol_topic = "{ctl}"\n'
                      f'[repository]\npath = "{repo}"\nmodels = ["a"]\n')  # fmt: skip
    env = {**FAST_GROUP, **EOS, "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": guarantee,
           "INFER_WORKER_REPOSITORY__PATH": str(repo),
           "INFER_WORKER_REPOSITORY__MODELS": "a",
           "INFER_WORKER_KAFKA__CONTROL_TOPIC": ctl}  # fmt: skip
    rows = {m: _features(seed, CAP) for seed, m in enumerate(topics)}
    sent: Counter[str] = Counter()
    stop = asyncio.Event()  # set once b came and answered

    def spawn(member: str) -> WorkerProcess:
        static = {**env, "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": member}
        return spawn_worker(broker.bootstrap, input_topics=[topics["a"]],
                            output_topic=names["results"], dlq_topic=names["dlq"],
                            group_id=names["group"], extra_env=static)  # fmt: skip

    members = [spawn("m1"), spawn("m2")]
    committed = Collector(broker.bootstrap, [names["results"]], isolation_level="read_committed")
    await committed.start()
    reader = asyncio.create_task(committed.collect(lambda _: False, 3600))

    def answers() -> list[Result]:
        return [r.result() for r in committed.records.get(names["results"], [])]

    def answered(m: str) -> int:
        return sum(1 for r in answers() if r.source.topic == topics[m])

    try:
        await wait_assigned(members, PARTS, timeout=90.0)
        producing = _streams(broker.bootstrap, topics, rows, sent, stop, RATE)
        await until(lambda: answered("a") >= 40, 60, "a answering")
        assert answered("b") == 0  # b's requests wait: no member reads its topic yet
        copy_in("b", 2)
        await asyncio.to_thread(_cli, config, "load", "b", "--version", "1")
        await wait_assigned(members, 2 * PARTS, timeout=90.0)  # b's partitions too
        await until(lambda: answered("b") >= sent["b"] // 2, 90, "b's backlog answered")
        a_then = answered("a")
        await until(lambda: answered("a") >= a_then + 40, 60, "a answering beside b")
        stop.set()
        await producing
        assert max(sent.values()) < CAP, f"the stream ran out before b came: {sent}"
        total = sum(sent.values())
        await until(lambda: len({(r.source.topic, r.source.partition, r.source.offset)
                                 for r in answers()}) >= total, 120,
                    f"answers to all {total} requests")  # fmt: skip
        # Each member brought b and reads some of its partitions (its last assignment).
        for w in members:
            log = await asyncio.to_thread(Path(w.log_path).read_text)
            events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
            assert any(e["event"] == "model_arrived" for e in events), w.log_tail()
            last = [e for e in events if e["event"] == "partitions_assigned"][-1]
            assert any(p.startswith(f"{topics['b']}:") for p in last["partitions"]), last
        for w in members:
            assert w.terminate() == 0, w.log_tail()
            no_crash_in_log(w)
    finally:
        for w in members:
            w.kill()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await committed.stop()

    assert len(answers()) == total, f"{len(answers()) - total} answered twice"
    await _exactly_once(broker.bootstrap, topics, names, total)
    by_rid = {r.id: r for r in answers()}
    assert len(by_rid) == total
    checked: dict[str, list[tuple[Result, np.ndarray]]] = defaultdict(list)
    for rid, r in by_rid.items():
        m, i = rid.split("-")
        assert r.status == "ok", (rid, r.error)
        assert (r.model.name, r.model.version) == (m, content_version(files[m])), rid
        checked[m].append((r, rows[m][int(i)]))
    for m, got in checked.items():
        _equal_alone(files[m], got)
    assert json.dumps(sorted(checked)) == '["a", "b"]'
