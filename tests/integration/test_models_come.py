"""Models that come while serving (``worker.app.arrivals``, issue 68), on both
brokers: a worker serves the repository's one model (``repository.models``
names it alone); a second model is copied into the repository and
``infer-worker models load`` brings it on its own topic (its ``model.toml``'s),
without a restart: the worker reads that topic from then
on and answers it with the new model (each answer equal to the model run
alone), the first model's answers unchanged beside it. A record bringing a model
whose topic does not exist is refused, naming it, and the worker serves on. A
member started afterwards (its configuration unchanged) serves the brought model
from its first answer: the control topic is replayed before it joins the group."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from tests.integration.test_model_control import _answers, _post
from tests.onnx_models import run_alone, tabular
from worker.config import KafkaConfig
from worker.contract import Result
from worker.kafka import control
from worker.model.files import content_version
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")


def _model(repo: Path, name: str, seed: int, topic: str) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "model.toml").write_text(f'topics = ["{topic}"]\n')
    return tabular(repo / name / "1" / "model.onnx", seed=seed)


def _index(port: int) -> list[dict[str, str]]:
    code, listed = _post(port, "/v2/repository/index")
    assert code == 200, listed
    return cast(list[dict[str, str]], listed)


async def test_a_model_copied_into_the_repository_comes_on_its_own_topic(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    base = names["requests"]
    topics = {"scorer": f"{base}.scorer", "ranker": f"{base}.ranker", "ctl": f"{base}.control",
              "more": f"{base}.scorer-more"}  # fmt: skip
    await create_topics(broker.bootstrap, {topics["scorer"]: 2, topics["ranker"]: 2,
                                           topics["more"]: 2, names["results"]: 1,
                                           names["dlq"]: 1, topics["ctl"]: 1})  # fmt: skip
    repo = tmp_path / "models"
    files = {"scorer": _model(repo, "scorer", 1, topics["scorer"])}
    config = tmp_path / "worker.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
                      f'input_topics = ["{topics["scorer"]}"]\ncontrol_topic = "{topics["ctl"]}"\n'
                      f'[repository]\npath = "{repo}"\nmodels = ["scorer"]\n')  # fmt: skip
    # The scorer alone at start-up: any other model comes through the control topic.
    env = {"INFER_WORKER_REPOSITORY__PATH": str(repo), "INFER_WORKER_REPOSITORY__MODELS": "scorer",
           "INFER_WORKER_KAFKA__CONTROL_TOPIC": topics["ctl"]}  # fmt: skip
    rng = np.random.default_rng(68)

    def rows(prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}-{i}": rng.normal(size=4).astype(np.float32) for i in range(10)}

    def spawn() -> WorkerProcess:
        return spawn_worker(broker.bootstrap, input_topics=[topics["scorer"]],
                            output_topic=names["results"], dlq_topic=names["dlq"],
                            group_id=names["group"], extra_env=env)  # fmt: skip

    offsets: dict[str, int] = {}  # answers read so far, by topic
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap, input_topics=(topics["scorer"],),
                        control_topic=topics["ctl"])  # fmt: skip
    answers: dict[str, tuple[str, dict[str, Result], dict[str, np.ndarray]]] = {}

    async def ask(phase: str, model: str, topic: str) -> None:
        """Ten requests to ``topic`` as ``phase``, answered by ``model``."""
        sent = rows(phase)
        got = await _answers(broker, topic, names["results"], phase, sent, offsets)
        answers[phase] = (model, got, sent)

    first = spawn()
    late: WorkerProcess | None = None
    try:
        await asyncio.to_thread(first.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 2, 90.0,
                                "assignment")  # fmt: skip
        await ask("before", "scorer", topics["scorer"])
        # A model copied into the repository after start-up, brought by the CLI.
        files["ranker"] = _model(repo, "ranker", 2, topics["ranker"])
        cli_env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
        run = [sys.executable, "-m", "worker", "models", "load", "ranker", "--version", "1",
               "--config", str(config)]  # fmt: skip
        loaded = await asyncio.to_thread(subprocess.run, run, env=cli_env, capture_output=True,
                                         text=True, timeout=60, check=False)  # fmt: skip
        assert loaded.returncode == 0, loaded.stderr
        # (The scrape sums a series over its model label: both models loaded.)
        await asyncio.to_thread(first.wait_until, lambda m: m.get("infer_model_loaded") == 2.0,
                                60.0, "the ranker brought")  # fmt: skip
        # Its topic joins the subscription (a rebalance): 2 more partitions.
        await asyncio.to_thread(first.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 4, 90.0,
                                "the ranker's partitions")  # fmt: skip
        await ask("ranker", "ranker", topics["ranker"])
        await ask("beside", "scorer", topics["scorer"])
        # The scorer, served since start-up, given a second topic (its own kept).
        more = {"version": 1, "settings": {"topics": [topics["scorer"], topics["more"]]}}
        await control.write(kafka, "scorer", more)
        await asyncio.to_thread(first.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 6, 90.0,
                                "the scorer's second topic")  # fmt: skip
        await ask("more", "scorer", topics["more"])
        # The next `models load` of it keeps those topics (a record is its whole state).
        again = await asyncio.to_thread(subprocess.run, [*run[:5], "scorer", *run[6:]],
                                        env=cli_env, capture_output=True, text=True, timeout=60,
                                        check=False)  # fmt: skip
        assert again.returncode == 0, again.stderr
        listed = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "worker", "models", "list", "--config", str(config)],
            env=cli_env, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        kept = json.dumps({"topics": [topics["scorer"], topics["more"]]})
        assert f"  scorer  version 1 with settings {kept}" in listed.stdout, listed.stdout
        # The OIP repository index: the ranker READY where this member serves it (once
        # the member is ready: a readiness probe may time out on 2 busy cores).
        want = {("scorer", "1"): "READY", ("ranker", "1"): "READY"}
        for _ in range(100):
            index = {(v["name"], v["version"]): v["state"]
                     for v in _index(first.metrics_port)}  # fmt: skip
            if index == want:
                break
            await asyncio.sleep(0.2)
        assert index == want, (index, first.log_tail(30))
        # A model whose topic does not exist, loaded through the OIP: the record is
        # written (200), then refused by the worker naming the topic; it serves on.
        _model(repo, "third", 3, f"{base}.missing")
        refused = first.metrics().get('infer_model_swaps_total{outcome="refused"}', 0.0)
        code, body = _post(first.metrics_port, "/v2/repository/models/third/load",
                           {"parameters": {"version": 1}})  # fmt: skip
        assert code == 200, body
        await asyncio.to_thread(
            first.wait_until,
            lambda m: m.get('infer_model_swaps_total{outcome="refused"}', 0.0) > refused,
            60.0, "the refusal of 'third'")  # fmt: skip
        assert f"['{base}.missing'] do not exist" in first.log_tail(200)
        state = {v["name"]: v for v in _index(first.metrics_port)}
        assert state["third"]["state"] == "UNAVAILABLE", state
        assert f"['{base}.missing'] do not exist" in state["third"]["reason"], state
        # Never reported missing while the subscription grew (readiness held).
        assert '"input_topics_missing"' not in Path(first.log_path).read_text()  # noqa: ASYNC240
        assert first.terminate() == 0, first.log_tail()
        # A member started later: the ranker and the scorer's second topic from its
        # first answer, no record written since.
        late = spawn()
        await asyncio.to_thread(late.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 6, 90.0,
                                "the late member's assignment")  # fmt: skip
        await ask("late", "ranker", topics["ranker"])
        await ask("late-more", "scorer", topics["more"])
    finally:
        first.kill()
        if late is not None:
            assert late.terminate() == 0, late.log_tail()
    for phase, (model, got, sent) in answers.items():
        for rid, r in got.items():
            assert r.status == "ok", (phase, rid, r.error)
            assert (r.model.name, r.model.version) == (model, content_version(files[model])), (
                phase, rid)  # fmt: skip
            alone = run_alone(files[model], {"features": sent[rid]})
            np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(),
                                       alone["probabilities"], rtol=1e-5, atol=1e-6)  # fmt: skip
