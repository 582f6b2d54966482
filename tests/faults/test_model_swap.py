"""A model swapped without leaving the group (issue 30, item 4): a worker with
``model.reload_interval_s`` serves a model file that is replaced under load,
atomically, by a new version (the same weights, another content hash, so its
answers can be checked) and then by a broken one (another model's inputs). On
Apache Kafka, at-least-once: every request is answered once, no rebalance
happens, per partition every answer before the swap point carries the old
version and every one after it the new one, and the broken version is refused
while the new one keeps serving."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import onnx
import pytest

from worker.model.files import bundled_file, content_version
from worker.ops.broker import Broker, create_topics
from worker.ops.topics import Collector, produce_all
from worker.ops.verify import check, read_topics

from .conftest import no_crash_in_log, request, start, wait_assigned

pytestmark = pytest.mark.faults

PARTS, N = 2, 1200


def replace(path: Path, source: Path) -> None:
    """As an operator should: a temporary file beside it, renamed over it."""
    tmp = path.with_suffix(".tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, path)


def rebalances(m: dict[str, float]) -> float:
    return m.get('infer_rebalances_total{kind="assigned"}', 0.0)


def swaps(m: dict[str, float], outcome: str) -> float:
    return m.get(f'infer_model_swaps_total{{outcome="{outcome}"}}', 0.0)


@pytest.mark.parametrize("broker_kind", ["kafka"])
@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-another-model"])
async def test_a_new_version_is_swapped_in_under_load_and_a_broken_one_refused(
    broker: Broker, names: dict[str, str], tmp_path: Path, beside: bool
) -> None:
    """``beside``: the worker serves a second model too (one a request may name
    on the same topic; issue 64: swapping was refused beside other models)."""
    old = tmp_path / "v1.onnx"
    shutil.copyfile(bundled_file("digits.onnx"), old)
    renamed = onnx.load(str(old))
    renamed.doc_string = "digits, re-exported"  # same weights, another content hash
    new = tmp_path / "v2.onnx"
    onnx.save(renamed, str(new))
    v1, v2 = content_version(old), content_version(new)
    served = tmp_path / "model.onnx"
    shutil.copyfile(old, served)
    await create_topics(broker.bootstrap, {names["requests"]: PARTS, names["results"]: PARTS,
                                           names["dlq"]: 1})  # fmt: skip
    reload = {"INFER_WORKER_MODEL__PATH": str(served), "INFER_WORKER_MODEL__INPUT": "image",
              "INFER_WORKER_MODEL__RELOAD_INTERVAL_S": "0.2"}  # fmt: skip
    if beside:
        reload["INFER_WORKER_MODELS__OTHER__PATH"] = "builtin:sentiment"
    w = start(broker, names, **reload)
    results = Collector(broker.bootstrap, [names["results"]])
    await results.start()
    try:
        await wait_assigned([w], PARTS)
        before = rebalances(await asyncio.to_thread(w.metrics))
        producing = asyncio.create_task(produce_all(
            broker.bootstrap, names["requests"], [(None, request(i)) for i in range(N)],
            partition_of=lambda i: i % PARTS, rate=400,
        ))  # fmt: skip
        assert await results.collect(lambda c: c.count() >= N // 4, 60.0), w.log_tail()
        replace(served, new)
        await asyncio.to_thread(w.wait_until, lambda m: swaps(m, "swapped") >= 1, 30.0, "swap")
        replace(served, bundled_file("sentiment.onnx"))  # other inputs: must be refused
        await asyncio.to_thread(w.wait_until, lambda m: swaps(m, "refused") >= 1, 30.0, "refusal")
        await producing
        assert await results.collect(lambda c: c.count() >= N, 60.0), w.log_tail()
        def answered(m: dict[str, float]) -> bool:  # one series per lane, summed
            return sum(v for k, v in m.items() if k.startswith("infer_request_seconds_count")) >= N

        m = await asyncio.to_thread(w.wait_until, answered, 30.0, "every answer's latency")
        latencies = await asyncio.to_thread(request_counts_by_version, w.metrics_port)
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        w.kill()
        await results.stop()
    assert rebalances(m) == before, "a swap must not make the worker leave the group"
    assert swaps(m, "swapped") == 1 and swaps(m, "refused") == 1
    inputs, seen = await read_topics(broker.bootstrap, [names["requests"]], names["results"],
                                     names["dlq"], idle_timeout=1.5)  # fmt: skip
    report = check(inputs, list(seen.answers), unparseable=seen.unparseable, strict=True)
    assert report.totals.requests == N and report.ok, report.format()
    versions: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for rec in results.records[names["results"]]:
        r = rec.result()
        assert r.status == "ok", r.error
        versions[r.source.partition].append((r.source.offset, r.model.version))
    for partition, answered in versions.items():
        ordered = [v for _, v in sorted(answered)]
        assert set(ordered) <= {v1, v2}, set(ordered)
        switch = ordered.index(v2) if v2 in ordered else len(ordered)
        assert ordered[:switch] == [v1] * switch, f"partition {partition}: old after new"
        assert ordered[switch:] == [v2] * (len(ordered) - switch), f"partition {partition}"
    assert any(v2 in [v for _, v in a] for a in versions.values()), "nothing answered by v2"
    assert any(v1 in [v for _, v in a] for a in versions.values()), "nothing answered by v1"
    # Each version's latencies are its own (issue 37: "p99 by model version").
    by_version = Counter(v for answered in versions.values() for _, v in answered)
    assert latencies == dict(by_version), (latencies, by_version)


def request_counts_by_version(port: int) -> dict[str, int]:
    """``infer_request_seconds_count`` per ``version`` label, from the raw exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.findall(r'^infer_request_seconds_count\{[^}]*version="([^"]+)"[^}]*\} (\S+)$',
                       text, re.MULTILINE)  # fmt: skip
    counts: Counter[str] = Counter()
    for version, count in found:  # one series per lane, summed
        counts[version] += int(float(count))
    return dict(counts)
