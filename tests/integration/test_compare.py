"""Rolling out a model safely, end to end on the embedded broker: production and
two shadow workers (``kafka.shadow = true``, each its own group and result
topic) read one input topic; ``python -m worker compare`` then passes the shadow
serving the same model and fails the one serving it with a skewed
preprocessing (no normalisation: the training/serving skew a rollout gate is
for). The shadows write no DLQ record and no crash-guard mark."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.contract import Request, Tensor, encode_request
from worker.model.files import bundled_file
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, committed_offsets, produce_all

pytestmark = pytest.mark.integration

N = 40  # digits, each with its label in meta
BAD = 2  # undecodable records: production's DLQ answers them, the shadows' nobody


def requests() -> list[tuple[bytes | None, bytes]]:
    samples = np.load(bundled_file("digits_samples.npz"))
    out: list[tuple[bytes | None, bytes]] = []
    for i in range(N):
        image = Tensor.from_numpy(samples["images"][i])
        meta = {"label": int(samples["labels"][i])}
        out.append((None, encode_request(Request(1, f"d{i}", {"image": image}, meta=meta))))
    return out + [(None, b"\xc1 not msgpack")] * BAD


async def compare(broker: Broker, names: dict[str, str], candidate: str, out: Path,
                  *flags: str) -> tuple[int, dict[str, Any], str]:  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "compare",
        "--bootstrap-servers", broker.bootstrap,
        "--baseline", names["results"], "--candidate", candidate,
        "--input-topic", names["requests"], "--label-key", "label",
        "--idle-timeout", "1", "--timeout", "30", "--json", str(out), *flags,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    text = stdout.decode() + stderr.decode()
    return proc.returncode, json.loads(await asyncio.to_thread(out.read_text)), text


@pytest.mark.parametrize("broker_kind", ["embedded"])
async def test_shadows_beside_production_and_compare_gates_the_candidate(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    same, skewed = f"{names['results']}.same", f"{names['results']}.skewed"
    await create_topics(
        broker.bootstrap,
        {names["requests"]: 2, names["results"]: 1, same: 1, skewed: 1,
         names["dlq"]: 1, names["guard"]: 1},
    )  # fmt: skip
    guarded = {"INFER_WORKER_KAFKA__CRASH_GUARD_TOPIC": names["guard"]}
    shadow = {**guarded, "INFER_WORKER_KAFKA__SHADOW": "true"}
    no_normalisation = {
        "INFER_WORKER_MODEL__PREPROCESS__MEAN": "[0.0]",
        "INFER_WORKER_MODEL__PREPROCESS__STD": "[1.0]",
    }
    # The shadows share production's DLQ and crash-guard topics (a copy of its
    # settings with only the group and the result topic changed): they must
    # write to neither.
    workers: dict[str, WorkerProcess] = {}
    for name, group, output, env in (
        ("production", names["group"], names["results"], guarded),
        ("same", f"{names['group']}.same", same, shadow),
        ("skewed", f"{names['group']}.skewed", skewed, {**shadow, **no_normalisation}),
    ):
        workers[name] = spawn_worker(
            broker.bootstrap, input_topics=[names["requests"]], output_topic=output,
            dlq_topic=names["dlq"], group_id=group, extra_env=env,
        )  # fmt: skip
    try:
        for w in workers.values():
            await asyncio.to_thread(
                w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 60.0,
                "partition assignment",
            )  # fmt: skip
        await produce_all(broker.bootstrap, names["requests"], requests())
        c = Collector(broker.bootstrap, [names["results"], same, skewed, names["dlq"]])
        await c.start()
        try:
            want = {names["results"]: N, same: N, skewed: N, names["dlq"]: BAD}
            done = await c.collect(lambda c: all(c.count(t) >= n for t, n in want.items()), 60)
            assert done, {t: c.count(t) for t in want}
        finally:
            await c.stop()
        for w in workers.values():
            # Every record read and settled, the undecodable ones too (a shadow
            # holds nothing back for want of a DLQ record).
            await asyncio.to_thread(
                w.wait_until, lambda m: m.get("infer_records_consumed_total", 0) >= N + BAD
                and m.get("infer_inflight_records", 1) == 0, 30.0, "every record settled",
            )  # fmt: skip
    finally:
        exits = {name: w.terminate() for name, w in workers.items()}
    assert exits == dict.fromkeys(workers, 0), {n: w.log_tail() for n, w in workers.items()}
    for name, group in (("same", ".same"), ("skewed", ".skewed")):
        committed = await committed_offsets(
            broker.bootstrap, names["group"] + group, names["requests"], 2
        )
        assert sum(committed.values()) == N + BAD, (name, committed)
        log = await asyncio.to_thread(Path(workers[name].log_path).read_text)
        assert '"crash_loop_protection_off"' in log and "kafka.shadow" in log
        assert '"sent_to": "none (shadow)"' in log

    # Only production's answers on the DLQ, and only its marks on the guard topic.
    c = Collector(broker.bootstrap, [names["dlq"], names["guard"]])
    await c.start()
    try:
        await c.collect(lambda c: False, 1.5)  # everything there is, read to the end
    finally:
        await c.stop()
    assert len(c.records[names["dlq"]]) == BAD
    marks = {r.record_key.decode().split("/")[0] for r in c.records[names["guard"]] if r.record_key}
    assert marks == {names["group"]}

    gate = ("--min-top1", "0.99", "--max-abs-diff", "1e-4", "--min-coverage", "0.99",
            "--max-error-diff", "0")  # fmt: skip
    (rc_same, same_doc, same_text), (rc_skew, skew_doc, skew_text) = await asyncio.gather(
        compare(broker, names, same, tmp_path / "same.json", *gate),
        compare(broker, names, skewed, tmp_path / "skewed.json", *gate),
    )
    assert rc_same == 0, same_text
    agree = same_doc["outputs"]["topk_indices"]
    assert agree["top1_agreement"] == 1.0 and agree["topk_agreement"] == 1.0
    assert same_doc["coverage"]["requests"] == N + BAD
    assert (same_doc["coverage"]["joined"], same_doc["status"]["differs"]) == (N, 0)
    accuracy = same_doc["accuracy"]["outputs"]["topk_indices"]
    assert accuracy["baseline"] == accuracy["candidate"] and accuracy["baseline"]["labelled"] == N
    assert accuracy["baseline"]["accuracy"] >= 0.9  # the bundled model's held-out 0.975
    version = same_doc["models"]["baseline"][0]
    assert same_doc["latency"]["candidate"][version]["total"]["n"] == N
    assert same_doc["failures"] == []

    assert rc_skew == 1, skew_text
    top1 = skew_doc["outputs"]["topk_indices"]["top1_agreement"]
    assert top1 < 0.99 and skew_doc["coverage"]["joined"] == N
    assert f"threshold not met: --min-top1 0.99: topk_indices agrees on {top1:.4f}" in skew_text
    accuracy = skew_doc["accuracy"]["outputs"]["topk_indices"]
    assert accuracy["candidate"]["accuracy"] < accuracy["baseline"]["accuracy"]


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_a_shadow_started_on_a_backlog_passes_the_gate_within_its_window(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    """Issue 37: a shadow started beside production on a topic with a backlog of
    deadline-carrying requests answers them after their deadlines
    (``deadline_exceeded``), differences that are not its model's. ``compare
    --since <its start>`` compares the requests written since (found by
    timestamp on Apache Kafka) and passes a strict gate; the backlog is reported
    as left out. CI runs a 1,500-request backlog; the issue's 10,000 is
    ``COMPARE_BACKLOG=10000`` (run so, BENCHMARKS.md)."""
    backlog, fresh = int(os.environ.get("COMPARE_BACKLOG", "1500")), 200
    shadow_out = f"{names['results']}.shadow"
    await create_topics(broker.bootstrap, {names["requests"]: 2, names["results"]: 1,
                                           shadow_out: 1, names["dlq"]: 1})  # fmt: skip
    samples = np.load(bundled_file("digits_samples.npz"))

    def batch(first: int, n: int, deadline_s: float) -> list[tuple[bytes | None, bytes]]:
        deadline_ms = int((time.time() + deadline_s) * 1000)
        return [(None, encode_request(Request(
            1, f"d{i}", {"image": Tensor.from_numpy(samples["images"][i % 300])},
            deadline_ms=deadline_ms, meta={"label": int(samples["labels"][i % 300])})))
            for i in range(first, first + n)]  # fmt: skip

    def worker(group: str, output: str, **env: str) -> WorkerProcess:
        return spawn_worker(broker.bootstrap, input_topics=[names["requests"]],
                            output_topic=output, dlq_topic=names["dlq"], group_id=group,
                            extra_env=env)  # fmt: skip

    def assigned(w: WorkerProcess) -> None:
        w.wait_until(lambda m: m.get("infer_assigned_partitions", 0) >= 2, 60.0, "assignment")

    production = worker(names["group"], names["results"])
    shadow: WorkerProcess | None = None
    c = Collector(broker.bootstrap, [names["results"], shadow_out])
    try:
        await asyncio.to_thread(assigned, production)
        await produce_all(broker.bootstrap, names["requests"], batch(0, backlog, 4.0),
                          partition_of=lambda i: i % 2)  # fmt: skip
        await c.start()
        assert await c.collect(lambda c: c.count(names["results"]) >= backlog, 60)
        await asyncio.sleep(4.5)  # every backlog deadline has passed
        since = time.time()
        shadow = worker(f"{names['group']}.shadow", shadow_out, INFER_WORKER_KAFKA__SHADOW="true")
        await asyncio.to_thread(assigned, shadow)
        await produce_all(broker.bootstrap, names["requests"], batch(backlog, fresh, 60.0),
                          partition_of=lambda i: i % 2)  # fmt: skip
        want = {names["results"]: backlog + fresh, shadow_out: backlog + fresh}
        assert await c.collect(lambda c: all(c.count(t) >= n for t, n in want.items()), 90)
    finally:
        production.kill()
        if shadow is not None:
            shadow.kill()
        await c.stop()
    late = [r for r in c.records[shadow_out] if r.result().status != "ok"]
    assert len(late) >= backlog * 0.9, "the shadow answered the backlog in time: no test"
    assert all(r.result().error.code == "deadline_exceeded" for r in late)  # type: ignore[union-attr]

    gate = ("--min-top1", "1.0", "--min-coverage", "0.99", "--max-error-diff", "0",
            "--since", f"{since:.3f}")  # fmt: skip
    rc, doc, text = await compare(broker, names, shadow_out, tmp_path / "since.json", *gate)
    assert rc == 0, text
    assert doc["coverage"]["joined"] == fresh and doc["status"]["differs"] == 0
    assert doc["coverage"]["outside_window"] == {"baseline": backlog, "candidate": backlog}
    assert doc["outputs"]["topk_indices"]["top1_agreement"] == 1.0
