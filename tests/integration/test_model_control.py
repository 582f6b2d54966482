"""A repository model's version set through the control topic
(``kafka.control_topic``, issue 68), on both brokers: a worker serves the
scorer's latest version (2), ``infer-worker models load scorer --version 1``
writes the desired version and the worker swaps it in while serving (its
answers then carry version 1's hash and equal version 1 run alone, none lost);
a record naming a version the repository does not hold is refused and version 1
keeps serving; a member started afterwards reads the topic from the beginning
and serves version 1 from its first answer, loading only the last record's;
its metrics port answers the Open Inference Protocol's repository extension
(the index; an unload, after which its requests are answered unknown_model
saying so; a load of version 2 that it then serves)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from tests.onnx_models import run_alone, tabular
from tests.serving import wire
from worker.config import KafkaConfig
from worker.contract import Result, Tensor
from worker.kafka import control
from worker.model.files import content_version
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")


def _repository(root: Path, topic: str) -> Path:
    repo = root / "models"
    for version in (1, 2):
        (repo / "scorer" / str(version)).mkdir(parents=True)
        tabular(repo / "scorer" / str(version) / "model.onnx", seed=version)
    (repo / "scorer" / "model.toml").write_text(f'topics = ["{topic}"]\n')  # every version's
    return repo


def _post(port: int, path: str, body: object = None) -> tuple[int, dict[str, Any]]:
    """POST to the metrics port: the status and JSON answer."""
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _card_versions(port: int) -> list[str]:
    """The versions the scorer's model card names (/v2/models/scorer)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/scorer", timeout=10) as r:
        return cast(list[str], json.loads(r.read())["versions"])


def _index(port: int) -> dict[str, str]:
    """The repository index's scorer versions and their states."""
    code, listed = _post(port, "/v2/repository/index")
    assert code == 200
    return {v["version"]: v["state"] for v in cast(list[dict[str, str]], listed)
            if v["name"] == "scorer"}


def _swaps(w: WorkerProcess, outcome: str) -> float:
    return w.metrics().get(f'infer_model_swaps_total{{outcome="{outcome}"}}', 0.0)


async def _answers(broker: Broker, topic: str, out: str, prefix: str, rows: dict[str, np.ndarray],
                   offsets: dict[str, int]) -> dict[str, Result]:  # fmt: skip
    """Send ``rows`` as requests ``PREFIX-i`` and read their answers."""
    await produce_all(broker.bootstrap, topic, [
        (rid.encode(), wire(rid, {"features": Tensor.from_numpy(v)})) for rid, v in rows.items()
    ])  # fmt: skip
    c = Collector(broker.bootstrap, [out])
    await c.start()
    try:
        want = offsets.get(out, 0) + len(rows)
        assert await c.collect(lambda c: c.count() >= want, 60.0), f"{c.count()} of {want}"
    finally:
        await c.stop()
    offsets[out] = c.count()
    got = {r.result().id: r.result() for r in c.records[out]}
    return {rid: got[rid] for rid in rows}


async def test_a_version_set_on_the_control_topic_is_swapped_in_by_every_member(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topic, ctl = f"{names['requests']}.scorer", f"{names['requests']}.control"
    await create_topics(broker.bootstrap, {topic: 2, names["results"]: 1, names["dlq"]: 1,
                                           ctl: 1})  # fmt: skip
    repo = _repository(tmp_path, topic)
    files = {v: repo / "scorer" / str(v) / "model.onnx" for v in (1, 2)}
    config = tmp_path / "worker.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
                      f'input_topics = ["{topic}"]\ncontrol_topic = "{ctl}"\n'
                      f'[repository]\npath = "{repo}"\n')  # fmt: skip
    env = {"INFER_WORKER_REPOSITORY__PATH": str(repo), "INFER_WORKER_KAFKA__CONTROL_TOPIC": ctl}
    rng = np.random.default_rng(68)
    batch = {s: {f"{s}-{i}": rng.normal(size=4).astype(np.float32) for i in range(12)}
             for s in ("before", "after", "late", "unloaded", "final")}  # fmt: skip
    offsets: dict[str, int] = {}

    def spawn(group: str) -> WorkerProcess:
        return spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=names["results"],
                            dlq_topic=names["dlq"], group_id=group, extra_env=env)  # fmt: skip

    first = spawn(names["group"])
    late: WorkerProcess | None = None
    try:
        await asyncio.to_thread(first.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0,
                                "assignment")  # fmt: skip
        answers = {"before": await _answers(broker, topic, names["results"], "before",
                                            batch["before"], offsets)}  # fmt: skip
        # What an operator runs: checked against the repository, then written.
        cli_env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
        run = [sys.executable, "-m", "worker", "models", "load", "scorer", "--config", str(config)]
        refused = await asyncio.to_thread(subprocess.run, [*run, "--version", "3"], env=cli_env,
                                          capture_output=True, text=True, timeout=60,
                                          check=False)  # fmt: skip
        assert refused.returncode == 2 and "has no version 3 (it holds 1, 2)" in refused.stderr
        loaded = await asyncio.to_thread(subprocess.run, [*run, "--version", "1"], env=cli_env,
                                         capture_output=True, text=True, timeout=60,
                                         check=False)  # fmt: skip
        assert loaded.returncode == 0, loaded.stderr
        await asyncio.to_thread(first.wait_until, lambda m: _swaps(first, "swapped") >= 1, 60.0,
                                "the swap to version 1")  # fmt: skip
        # A record the CLI would refuse, written by another tool: refused by the worker.
        await control.write(KafkaConfig(bootstrap_servers=broker.bootstrap,
                                        input_topics=(topic,), control_topic=ctl),
                            "scorer", {"version": 7})  # fmt: skip
        await asyncio.to_thread(first.wait_until, lambda m: _swaps(first, "refused") >= 1, 60.0,
                                "the refusal of version 7")  # fmt: skip
        answers["after"] = await _answers(broker, topic, names["results"], "after",
                                          batch["after"], offsets)  # fmt: skip
        assert first.terminate() == 0, first.log_tail()
        for version in (2, 1):  # more history: the topic now holds 1, 7, 2, 1
            await control.write(KafkaConfig(bootstrap_servers=broker.bootstrap,
                                            input_topics=(topic,), control_topic=ctl),
                                "scorer", {"version": version})  # fmt: skip
        # A member started later (alone in the group): the topic read from the
        # beginning, version 1 before its first answer, loaded once (the last record).
        late = spawn(names["group"])
        await asyncio.to_thread(late.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0,
                                "the late member's assignment")  # fmt: skip
        assert _swaps(late, "swapped") == 1 and _swaps(late, "refused") == 0
        answers["late"] = await _answers(broker, topic, names["results"], "late",
                                         batch["late"], offsets)  # fmt: skip
        # The OIP repository extension on the late member's metrics port; its
        # model card names the version the topic set, not the one it loaded first.
        port = late.metrics_port
        assert _index(port) == {"1": "READY", "2": "UNAVAILABLE"}
        assert _card_versions(port) == [content_version(files[1])]
        # Unloaded through the topic: freed, and its requests answered unknown_model
        # saying so (none waits, none is lost), until a load names a version again.
        assert _post(port, "/v2/repository/models/scorer/unload")[0] == 200
        await asyncio.to_thread(late.wait_until,
                                lambda m: m.get("infer_model_loaded") == 0.0,
                                60.0, "the unload")  # fmt: skip
        assert _index(port) == {"1": "UNAVAILABLE", "2": "UNAVAILABLE"}
        unloaded = await _answers(broker, topic, names["results"], "unloaded",
                                  batch["unloaded"], offsets)  # fmt: skip
        for r in unloaded.values():
            assert r.status == "error" and r.error is not None, r
            assert r.error.code == "unknown_model" and "is unloaded" in r.error.message, r.error
        load = "/v2/repository/models/scorer/load"
        code, body = _post(port, load, {"parameters": {"version": 9}})
        assert code == 400 and "has no version 9" in body["error"]
        code, _ = _post(port, load, {"parameters": {"version": 2}})
        assert code == 200
        await asyncio.to_thread(late.wait_until, lambda m: _swaps(late, "swapped") >= 2, 60.0,
                                "the swap back to version 2")  # fmt: skip
        assert _index(port) == {"1": "UNAVAILABLE", "2": "READY"}
        answers["final"] = await _answers(broker, topic, names["results"], "final",
                                          batch["final"], offsets)  # fmt: skip
    finally:
        first.kill()
        if late is not None:
            assert late.terminate() == 0, late.log_tail()
    served = {"before": 2, "after": 1, "late": 1, "final": 2}
    for phase, got in answers.items():
        version = served[phase]
        for rid, r in got.items():
            assert (r.status, r.model.version) == ("ok", content_version(files[version])), (
                phase, rid, r.error)  # fmt: skip
            alone = run_alone(files[version], {"features": batch[phase][rid]})
            np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(),
                                       alone["probabilities"], rtol=1e-5, atol=1e-6)  # fmt: skip
