"""Memory shared by demand (``repository.on_demand``, issue 68), on both brokers:
three repository models, each holding tens of MiB, under a budget that holds
at most two of them. Requests come to each model's topic in turn, so each round
needs a model that was evicted: it is loaded again, and every answer equals the
model run alone; the memory the loaded models hold never exceeds the budget at
any scrape or in any load's log line. ``models unload`` (a tombstone on the
control topic) frees a model, whose requests are then answered
``unknown_model`` saying so, and ``models load`` serves it again."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_model_control import _answers
from tests.onnx_models import run_alone, wide
from worker.contract import Result
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")

MODELS = ("a", "b", "c")
# A 24 MiB model measures 55-110 MiB resident as onnxruntime loads it (its
# weights, prepacked, and the allocator's own): one always fits, three never.
BUDGET_MB = 150


def _repository(root: Path, topics: dict[str, str]) -> dict[str, Path]:
    files = {}
    for seed, name in enumerate(MODELS, start=1):
        version = root / "models" / name / "1"
        version.mkdir(parents=True)
        files[name] = wide(version / "model.onnx", seed=seed, mib=24)
        (version.parent / "model.toml").write_text(f'topics = ["{topics[name]}"]\n')
    return files


def _within_budget(w: WorkerProcess) -> float:
    used = w.metrics()["infer_models_memory_used_bytes"]
    assert used <= BUDGET_MB << 20, f"{used / (1 << 20):.0f} MiB held, over {BUDGET_MB} MiB"
    return used


async def test_models_are_loaded_and_evicted_by_demand_within_the_budget(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topics = {m: f"{names['requests']}.{m}" for m in MODELS}
    ctl = f"{names['requests']}.control"
    made = {t: 1 for t in (*topics.values(), names["results"], names["dlq"], ctl)}
    await create_topics(broker.bootstrap, made)
    files = _repository(tmp_path, topics)
    repo = tmp_path / "models"
    config = tmp_path / "worker.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
                      f"input_topics = {json.dumps(list(topics.values()))}\n"
                      f'control_topic = "{ctl}"\n[repository]\npath = "{repo}"\n')  # fmt: skip
    env = {"INFER_WORKER_REPOSITORY__PATH": str(repo),
           "INFER_WORKER_REPOSITORY__ON_DEMAND": "true",
           "INFER_WORKER_LIMITS__MAX_MODELS_MEMORY_MB": str(BUDGET_MB),
           "INFER_WORKER_KAFKA__CONTROL_TOPIC": ctl}  # fmt: skip
    rng = np.random.default_rng(68)
    offsets: dict[str, int] = {}
    worker = spawn_worker(broker.bootstrap, input_topics=list(topics.values()),
                          output_topic=names["results"], dlq_topic=names["dlq"],
                          group_id=names["group"], extra_env=env)  # fmt: skip
    try:
        await asyncio.to_thread(worker.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 3, 90.0,
                                "assignment")  # fmt: skip
        assert worker.metrics()["infer_model_loaded"] < 3  # not all three held at once
        answers: dict[str, dict[str, Result]] = {}
        sent: dict[str, np.ndarray] = {}
        for round_ in range(3):  # a, b, c, a, b, c, ...: each round reloads what was evicted
            for m in MODELS:
                rows = {f"{m}-{round_}-{i}": rng.normal(size=4).astype(np.float32)
                        for i in range(8)}  # fmt: skip
                sent |= rows
                answers[m] = answers.get(m, {}) | await _answers(
                    broker, topics[m], names["results"], m, rows, offsets)  # fmt: skip
                _within_budget(worker)
        metrics = worker.metrics()
        assert metrics.get('infer_model_evictions_total{reason="room"}', 0) >= 3, metrics
        loads = sum(v for k, v in metrics.items() if k.startswith("infer_model_loads_total{"))
        assert loads >= 3

        # Unloaded through the control topic: freed, its requests answered
        # unknown_model saying so; loaded again by `models load`.
        cli_env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
        cli = [sys.executable, "-m", "worker", "models"]

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            command = [*cli, *args, "--config", str(config)]
            return subprocess.run(command, env=cli_env, capture_output=True, text=True,
                                  timeout=60, check=False)  # fmt: skip

        done = await asyncio.to_thread(run, "unload", "c")
        assert done.returncode == 0, done.stderr
        await asyncio.to_thread(
            worker.wait_until,
            lambda m: m.get('infer_model_evictions_total{reason="control"}', 0) >= 1, 60.0,
            "the unload")  # fmt: skip
        rows = {f"c-unloaded-{i}": rng.normal(size=4).astype(np.float32) for i in range(4)}
        refused = await _answers(broker, topics["c"], names["results"], "c", rows, offsets)
        for r in refused.values():
            assert r.status == "error" and r.error is not None, r
            assert r.error.code == "unknown_model" and "is unloaded" in r.error.message, r.error
        done = await asyncio.to_thread(run, "load", "c", "--version", "1")
        assert done.returncode == 0, done.stderr
        await asyncio.to_thread(
            worker.wait_until,
            lambda m: m.get('infer_model_loads_total{reason="control"}', 0) >= 1, 60.0,
            "the load")  # fmt: skip
        rows = {f"c-again-{i}": rng.normal(size=4).astype(np.float32) for i in range(8)}
        sent |= rows
        answers["c"] |= await _answers(broker, topics["c"], names["results"], "c", rows, offsets)
        _within_budget(worker)
    finally:
        code = worker.terminate()
    assert code == 0, worker.log_tail()
    for m, got in answers.items():
        for rid, r in got.items():
            assert r.status == "ok", (rid, r.error)
            alone = run_alone(files[m], {"features": sent[rid]})
            np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(),
                                       alone["probabilities"], rtol=1e-5, atol=1e-6)  # fmt: skip
    # Every load's own account: the models held after it, never over the budget.
    log = await asyncio.to_thread(Path(worker.log_path).read_text)
    loaded = [json.loads(line) for line in log.splitlines() if '"model_loaded"' in line]
    assert loaded and all(e["used_mib"] <= BUDGET_MB for e in loaded), loaded
