"""Repository models changed while they serve (issue 68), on Apache Kafka.

Under load, exactly-once: a worker with ``kafka.processing_guarantee =
"exactly-once"`` serves three repository models loaded by demand under a budget
that holds fewer than all three, while a steady stream of requests comes to
every model's topic. Meanwhile one model is unloaded (``models unload``: a
tombstone), loaded again at another version (``models load --version 1``) and
swapped back to the first (``--version 2``). A read_committed reader then sees
every request answered once, none lost; every "ok" answer equals its model's
version run alone; the changed model answered by version 2, "is unloaded",
version 1 and version 2 again, none before its record was written; the
unloaded window answered ``unknown_model`` saying so; models were evicted for
room and the memory the loads held never exceeded the budget.

Each partition's answers follow the changes in offset order (version 2, then
unloaded, then version 1, then version 2 again: a batch is let in by the
residency in the order it was dispatched, even where a later one finds its
model loaded; before that was so, an earlier record was answered by version 2
after a later one by version 1 in 3 runs of 4), and no answer of a state came
before that state's record was written (by the answers' Kafka timestamps).

Members converging: two members of one group read the control topic; records
written while one of them is down (a load, a tombstone and a load again of
one model, a tombstone of another, a version of a third) are replayed by the
member when it restarts, SIGKILLed or stopped: both members end up serving the
same versions and unloading the same model, as the Open Inference Protocol's
repository index on each member's metrics port, each member's own metrics and
the answers say.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_model_control import _post
from tests.onnx_models import run_each_alone, tabular, wide
from tests.serving import wire
from worker.config import KafkaConfig
from worker.contract import Result, Tensor
from worker.kafka import control
from worker.model.files import content_version
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, Produced, produce_all
from worker.ops.verify import check, read_topics

from .conftest import FAST_GROUP, no_crash_in_log, wait_assigned
from .test_exactly_once import EOS, until

pytestmark = pytest.mark.faults
pytest.importorskip("onnx")

PARTS = 2
COMPACTED = {"cleanup.policy": "compact"}


def _cli(config: Path, *args: str) -> None:
    """``infer-worker models ARGS --config CONFIG``, as an operator runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    done = subprocess.run([sys.executable, "-m", "worker", "models", *args, "--config",
                           str(config)], env=env, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 0, (args, done.stdout, done.stderr)


def _samples(port: int, name: str) -> list[tuple[dict[str, str], float]]:
    """A metric's samples with their labels, ``model`` and ``version`` kept
    (``WorkerProcess.metrics`` folds them away)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [(dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]  # fmt: skip


def _index(port: int) -> dict[str, dict[str, str]]:
    """The repository index on a member's metrics port: each model's versions' states."""
    code, listed = _post(port, "/v2/repository/index")
    assert code == 200, listed
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for v in cast(list[dict[str, str]], listed):
        out[v["name"]][v["version"]] = v["state"]
    return dict(out)


def _loaded(port: int) -> dict[str, float]:
    """``infer_model_loaded`` per model on a member."""
    return {labels["model"]: value for labels, value in _samples(port, "infer_model_loaded")}


def _now_ms() -> int:
    """Wall-clock milliseconds, as the answers' Kafka timestamps (their producer's
    clock, on this machine) count."""
    return int(time.time() * 1000)


def _features(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


def _streams(bootstrap: str, topics: Mapping[str, str], rows: Mapping[str, np.ndarray],
             sent: Counter[str], stop: asyncio.Event, rate: float,
             ) -> asyncio.Future[list[list[Produced]]]:  # fmt: skip
    """Each model's requests (``rows[m]``, ids ``m-i``) to its topic at ``rate``
    a second, counted in ``sent``, until ``stop`` is set or its rows run out."""

    def stream(m: str) -> Iterator[tuple[bytes, bytes]]:
        for i, row in enumerate(rows[m]):
            if stop.is_set():
                return
            sent[m] += 1
            rid = f"{m}-{i}"
            yield rid.encode(), wire(rid, {"features": Tensor.from_numpy(row)})

    return asyncio.gather(*(
        produce_all(bootstrap, topic, stream(m), partition_of=lambda i: i % PARTS, rate=rate,
                    seed=n)
        for n, (m, topic) in enumerate(topics.items())
    ))  # fmt: skip


async def _exactly_once(bootstrap: str, topics: Mapping[str, str], names: Mapping[str, str],
                        total: int) -> None:  # fmt: skip
    """Every request of ``topics`` answered once, none lost, none to the DLQ, as a
    read_committed reader and the strict verifier see it."""
    inputs, observed = await read_topics(bootstrap, list(topics.values()), names["results"],
                                         names["dlq"], idle_timeout=1.5,
                                         isolation_level="read_committed")  # fmt: skip
    report = check(inputs, list(observed.answers), unparseable=observed.unparseable, strict=True)
    assert report.totals.requests == total and report.ok, report.format()
    assert report.totals.lost == 0 and report.totals.surplus_answers == 0, report.format()
    assert all(a.kind == "result" for a in observed.answers), "an answer went to the DLQ"


def _equal_alone(file: Path, answers: list[tuple[Result, np.ndarray]]) -> None:
    """Each answer's probabilities are ``file``'s model run on its request alone."""
    alone = run_each_alone(file, [{"features": row} for _, row in answers])
    for (r, _), want in zip(answers, alone, strict=True):
        np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(),
                                   want["probabilities"], rtol=1e-5, atol=1e-6,
                                   err_msg=r.id)  # fmt: skip


# --- 1. load and unload under steady load, exactly-once ---------------------------

MODELS = ("a", "b", "c")  # c holds versions 1 and 2; 2 serves at start (the latest)
# As tests/integration/test_models_on_demand.py: a 24 MiB model measures 55-110
# MiB resident, so one always fits the budget and three never do.
BUDGET_MB = 150
CAP, RATE = 480, 9.0  # requests per model at most (the changes take 15-25 s), per second to each
KINDS = ("v2", "unloaded", "v1")  # of the changed model's answers


def _demand_repository(root: Path, topics: Mapping[str, str]) -> dict[str, dict[int, Path]]:
    files: dict[str, dict[int, Path]] = {}
    for seed, name in enumerate(MODELS, start=1):
        versions = (1, 2) if name == "c" else (1,)
        for version in versions:
            (root / name / str(version)).mkdir(parents=True)
            path = root / name / str(version) / "model.onnx"
            files.setdefault(name, {})[version] = wide(path, seed=10 * seed + version, mib=24)
        (root / name / "model.toml").write_text(f'topics = ["{topics[name]}"]\n')
    return files


SWAPPED = 'infer_model_swaps_total{outcome="swapped"}'


async def _at_least(w: WorkerProcess, series: str, n: float, what: str) -> None:
    """Until ``w``'s metric ``series`` (model and version folded) reaches ``n``."""
    await asyncio.to_thread(w.wait_until, lambda m: m.get(series, 0) >= n, 60.0, what)


def _kind(r: Result, versions: Mapping[str, str]) -> str:
    """What an answer of the changed model is: ``v1``/``v2`` (ok, by the
    version its hash names), ``unloaded``, or the unexpected as it is."""
    if r.status == "ok":
        return versions.get(r.model.version, f"ok from {r.model.version}")
    assert r.error is not None
    if r.error.code == "unknown_model" and "is unloaded" in r.error.message:
        return "unloaded"
    return f"{r.error.code}: {r.error.message}"


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_unload_load_and_swap_under_load_answer_every_request_exactly_once(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topics = {m: f"{names['requests']}.{m}" for m in MODELS}
    ctl = f"{names['requests']}.control"
    await create_topics(broker.bootstrap, {**{t: PARTS for t in topics.values()},
                                           names["results"]: PARTS, names["dlq"]: 1, ctl: 1},
                        {ctl: COMPACTED})  # fmt: skip
    repo = tmp_path / "models"
    files = _demand_repository(repo, topics)
    hashes = {m: {content_version(f): v for v, f in fs.items()} for m, fs in files.items()}
    c_versions = {h: f"v{v}" for h, v in hashes["c"].items()}
    config = tmp_path / "worker.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
                      f"input_topics = {json.dumps(list(topics.values()))}\n"
                      f'control_topic = "{ctl}"\n[repository]\npath = "{repo}"\n')  # fmt: skip
    env = {**FAST_GROUP, **EOS,
           "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": "m1",
           "INFER_WORKER_REPOSITORY__PATH": str(repo),
           "INFER_WORKER_REPOSITORY__ON_DEMAND": "true",
           "INFER_WORKER_LIMITS__MAX_MODELS_MEMORY_MB": str(BUDGET_MB),
           "INFER_WORKER_KAFKA__CONTROL_TOPIC": ctl}  # fmt: skip
    rows = {m: _features(seed, CAP) for seed, m in enumerate(MODELS)}
    sent: Counter[str] = Counter()
    stop = asyncio.Event()  # set once the changes are done

    w = spawn_worker(broker.bootstrap, input_topics=list(topics.values()),
                     output_topic=names["results"], dlq_topic=names["dlq"],
                     group_id=names["group"], extra_env=env)  # fmt: skip
    committed = Collector(broker.bootstrap, [names["results"]], isolation_level="read_committed")
    await committed.start()
    reader = asyncio.create_task(committed.collect(lambda _: False, 3600))

    def answers() -> list[Result]:
        return [r.result() for r in committed.records.get(names["results"], [])]

    def seen(kind: str) -> int:
        return sum(1 for r in answers()
                   if r.source.topic == topics["c"] and _kind(r, c_versions) == kind)  # fmt: skip

    try:
        await wait_assigned([w], len(MODELS) * PARTS, timeout=90.0)
        assert w.metrics()["infer_model_loaded"] < len(MODELS)  # not all held at once
        producing = _streams(broker.bootstrap, topics, rows, sent, stop, RATE)
        await until(lambda: seen("v2") >= 12, 60, "version 2 answering")
        written = {"unloaded": _now_ms()}  # the answers' Kafka timestamps' clock
        await asyncio.to_thread(_cli, config, "unload", "c")
        await until(lambda: seen("unloaded") >= 8, 60, "requests answered unloaded")
        # Unloaded as the member's repository index and metrics say (not evicted
        # for control where it had been evicted for room already).
        assert _index(w.metrics_port)["c"] == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}
        assert _loaded(w.metrics_port)["c"] == 0
        written["v1"] = _now_ms()
        await asyncio.to_thread(_cli, config, "load", "c", "--version", "1")
        await _at_least(w, SWAPPED, 1, "version 1 swapped in")
        await until(lambda: seen("v1") >= 12, 60, "version 1 answering")
        v2_before = seen("v2")
        written["v2"] = _now_ms()
        await asyncio.to_thread(_cli, config, "load", "c", "--version", "2")
        await _at_least(w, SWAPPED, 2, "version 2 swapped in again")
        await until(lambda: seen("v2") >= v2_before + 12, 60, "version 2 answering again")
        stop.set()
        await producing
        assert max(sent.values()) < CAP, f"the stream ran out before the changes were done: {sent}"
        total = sum(sent.values())
        await until(lambda: len({(r.source.topic, r.source.partition, r.source.offset)
                                 for r in answers()}) >= total, 120,
                    f"answers to all {total} requests")  # fmt: skip
        metrics = await asyncio.to_thread(w.metrics)
        assert w.terminate() == 0, w.log_tail()
        no_crash_in_log(w)
    finally:
        w.kill()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await committed.stop()

    await _exactly_once(broker.bootstrap, topics, names, total)

    # Each answer: the model's version run alone, or (the changed model) unloaded.
    by_rid = {r.id: r for r in answers()}
    stamps = {rec.result().id: rec.timestamp_ms for rec in committed.records[names["results"]]}
    assert len(by_rid) == total
    model_of = {t: m for m, t in topics.items()}
    checked: dict[Path, list[tuple[Result, np.ndarray]]] = defaultdict(list)
    c_kinds: dict[str, list[int]] = defaultdict(list)  # each kind's answers' timestamps
    for rid, r in by_rid.items():
        m, i = rid.split("-")
        assert model_of[r.source.topic] == m == r.model.name, r
        if m == "c":
            kind = _kind(r, c_versions)
            assert kind in KINDS, (rid, kind)
            c_kinds[kind].append(stamps[rid])
        else:
            assert r.status == "ok", (rid, r.error)
        if r.status == "ok":
            checked[files[m][hashes[m][r.model.version]]].append((r, rows[m][int(i)]))
    for file, got in checked.items():
        _equal_alone(file, got)
    # Each of c's partitions, by offset: the changes in the order they were made.
    by_partition: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for r in by_rid.values():
        if r.model.name == "c":
            by_partition[r.source.partition].append((r.source.offset, _kind(r, c_versions)))
    for partition, seen in by_partition.items():
        kinds = [kind for _, kind in sorted(seen)]
        assert _in_phase_order(kinds), (partition, kinds)
    # No state answered before its record was written; version 2 before and after.
    assert min(c_kinds["unloaded"]) >= written["unloaded"], (c_kinds, written)
    assert min(c_kinds["v1"]) >= written["v1"], (c_kinds, written)
    assert min(c_kinds["v2"]) < written["unloaded"], (c_kinds, written)
    assert sum(1 for t in c_kinds["v2"] if t >= written["v2"]) >= 12, (c_kinds, written)

    # Evicted for room while the stream ran; the memory held never over the budget.
    assert metrics.get('infer_model_evictions_total{reason="room"}', 0) >= 1, metrics
    assert metrics.get('infer_model_evictions_total{reason="control"}', 0) <= 1, metrics
    assert metrics[SWAPPED] == 2, metrics
    assert metrics.get('infer_model_swaps_total{outcome="refused"}', 0) == 0, metrics
    log = await asyncio.to_thread(Path(w.log_path).read_text)
    loaded = [json.loads(line) for line in log.splitlines() if '"model_loaded"' in line]
    assert loaded and all(e["used_mib"] <= BUDGET_MB for e in loaded), loaded


def _in_phase_order(kinds: list[str]) -> bool:
    """Whether ``kinds`` (one partition's answers, by offset) go through the
    changes' phases in order, each phase any number of times or none."""
    phases = ("v2", "unloaded", "v1", "v2")
    at = 0
    for kind in kinds:
        while at < len(phases) and phases[at] != kind:
            at += 1
        if at == len(phases):
            return False
    return True


# --- 2. two members converging after restarts -------------------------------------

SERVED = ("s", "t", "u")  # each with versions 1 and 2


async def _indexed(w: WorkerProcess, want: dict[str, dict[str, str]], what: str) -> None:
    """Until ``w``'s index is ``want`` (a record applied as it comes)."""
    await until(lambda: w.proc.poll() is None and _index(w.metrics_port) == want, 60, what)


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_members_restarted_between_control_records_converge_on_the_same_models(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topics = {m: f"{names['requests']}.{m}" for m in SERVED}
    ctl = f"{names['requests']}.control"
    await create_topics(broker.bootstrap, {**{t: PARTS for t in topics.values()},
                                           names["results"]: PARTS, names["dlq"]: 1, ctl: 1},
                        {ctl: COMPACTED})  # fmt: skip
    repo = tmp_path / "models"
    files: dict[str, dict[int, Path]] = {}
    for seed, name in enumerate(SERVED, start=1):
        for version in (1, 2):
            (repo / name / str(version)).mkdir(parents=True)
            path = repo / name / str(version) / "model.onnx"
            files.setdefault(name, {})[version] = tabular(path, seed=10 * seed + version)
        (repo / name / "model.toml").write_text(f'topics = ["{topics[name]}"]\n')
    env = {**FAST_GROUP, "INFER_WORKER_REPOSITORY__PATH": str(repo),
           "INFER_WORKER_KAFKA__CONTROL_TOPIC": ctl}  # fmt: skip
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap, input_topics=tuple(topics.values()),
                        control_topic=ctl)  # fmt: skip

    async def write(name: str, version: int | None) -> None:
        await control.write(kafka, name, None if version is None else {"version": version})

    def member(instance: str) -> WorkerProcess:
        own = {**env, "INFER_WORKER_KAFKA__GROUP_INSTANCE_ID": instance}
        return spawn_worker(broker.bootstrap, input_topics=list(topics.values()),
                            output_topic=names["results"], dlq_topic=names["dlq"],
                            group_id=names["group"], extra_env=own)  # fmt: skip

    def states(**serving: int | None) -> dict[str, dict[str, str]]:
        """The index where each model serves the version given (None: unloaded)."""
        return {m: {str(v): "READY" if serving[m] == v else "UNAVAILABLE" for v in (1, 2)}
                for m in SERVED}  # fmt: skip

    live = {"m1": member("m1"), "m2": member("m2")}
    gone: list[WorkerProcess] = []
    try:
        await wait_assigned(list(live.values()), len(SERVED) * PARTS, timeout=90.0)
        for w in live.values():  # the latest version of each, at start
            assert _index(w.metrics_port) == states(s=2, t=2, u=2)
        await write("s", 1)
        for w in live.values():
            await _indexed(w, states(s=1, t=2, u=2), "s at version 1 on both members")

        # m2 SIGKILLed; while it is down, t unloaded and loaded at version 1, s
        # back to 2, u unloaded. m1 applies each record as it comes; m2 replays them.
        victim = live.pop("m2")
        victim.kill()
        gone.append(victim)
        await write("t", None)
        await _indexed(live["m1"], states(s=1, t=None, u=2), "t unloaded on m1")
        records: tuple[tuple[str, int | None], ...] = (("s", 2), ("t", 1), ("u", None))
        for model, wanted in records:
            await write(model, wanted)
        await _indexed(live["m1"], states(s=2, t=1, u=None), "the records applied on m1")
        live["m2"] = member("m2")
        await wait_assigned(list(live.values()), len(SERVED) * PARTS, timeout=90.0)
        assert _index(live["m2"].metrics_port) == states(s=2, t=1, u=None)

        # m1 stopped; while it is down, s to version 1 again: m1 replays it all.
        stopped = live.pop("m1")
        assert stopped.terminate() == 0, stopped.log_tail()
        gone.append(stopped)
        await write("s", 1)
        await _indexed(live["m2"], states(s=1, t=1, u=None), "s at version 1 on m2")
        live["m1"] = member("m1")
        await wait_assigned(list(live.values()), len(SERVED) * PARTS, timeout=90.0)

        final = states(s=1, t=1, u=None)
        for name, w in live.items():
            assert _index(w.metrics_port) == final, name
            assert _loaded(w.metrics_port) == {"s": 1.0, "t": 1.0, "u": 0.0}, name

        # And the answers: each member answers its partitions of every model alike.
        per = 20
        feats = {m: _features(100 + seed, per) for seed, m in enumerate(SERVED)}
        results = Collector(broker.bootstrap, [names["results"]])
        await results.start()
        try:
            await asyncio.gather(*(produce_all(broker.bootstrap, topics[m], [
                (f"{m}-{i}".encode(), wire(f"{m}-{i}", {"features": Tensor.from_numpy(row)}))
                for i, row in enumerate(feats[m])], partition_of=lambda i: i % PARTS)
                for m in SERVED))  # fmt: skip
            want = per * len(SERVED)
            assert await results.collect(lambda c: c.count() >= want, 60.0), results.count()
        finally:
            await results.stop()
        counts = {name: _answered(w.metrics_port) for name, w in live.items()}
        for w in live.values():
            assert w.terminate() == 0, w.log_tail()
            no_crash_in_log(w)
    finally:
        for w in [*live.values(), *gone]:
            w.kill()

    got = {r.result().id: r.result() for r in results.records[names["results"]]}
    assert len(got) == per * len(SERVED)
    for m in ("s", "t"):
        answered = [(got[f"{m}-{i}"], row) for i, row in enumerate(feats[m])]
        for r, _ in answered:
            assert (r.status, r.model.version) == ("ok", content_version(files[m][1])), r
        _equal_alone(files[m][1], answered)
    for i in range(per):
        r = got[f"u-{i}"]
        assert r.status == "error" and r.error is not None, r
        assert r.error.code == "unknown_model" and "is unloaded" in r.error.message, r.error
    # Each member answered requests of s and t, and only with version 1.
    v1 = {m: content_version(files[m][1]) for m in ("s", "t")}
    for name, by_version in counts.items():
        for m in ("s", "t"):
            assert set(by_version.get(m, {})) == {v1[m]}, (name, m, by_version)


def _answered(port: int) -> dict[str, dict[str, float]]:
    """A member's answered requests per model and version (its latencies' counts)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for labels, value in _samples(port, "infer_request_seconds_count"):
        if value > 0:
            by = out[labels["model"]]
            by[labels["version"]] = by.get(labels["version"], 0.0) + value
    return dict(out)
