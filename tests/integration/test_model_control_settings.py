"""A control record's settings (issue 68: a model's desired state is its version
and settings), on both brokers: a worker serves a repository model's version 1
with only its ``score`` output (its model.toml); ``models load scorer --version
1 --settings '{"outputs": [...]}'`` adds ``probabilities`` over the same file,
swapped in while serving, its answers then carrying both, equal to the model
run alone, and ``models list`` reads that state back from the topic. Settings a
record may not carry are refused before anything is
written, by the CLI (exit 2) and by the Open Inference Protocol's load (400),
each naming the key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_model_control import _answers, _post, _swaps
from tests.onnx_models import run_alone, tabular
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import spawn_worker

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")


async def test_a_record_s_settings_are_swapped_in_while_serving(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topic, ctl = f"{names['requests']}.scorer", f"{names['requests']}.control"
    await create_topics(broker.bootstrap, {topic: 1, names["results"]: 1, names["dlq"]: 1,
                                           ctl: 1})  # fmt: skip
    repo = tmp_path / "models"
    (repo / "scorer" / "1").mkdir(parents=True)
    model = tabular(repo / "scorer" / "1" / "model.onnx", seed=3)
    (repo / "scorer" / "model.toml").write_text(f'topics = ["{topic}"]\noutputs = ["score"]\n')
    config = tmp_path / "worker.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
                      f'input_topics = ["{topic}"]\ncontrol_topic = "{ctl}"\n'
                      f'[repository]\npath = "{repo}"\n')  # fmt: skip
    env = {"INFER_WORKER_REPOSITORY__PATH": str(repo), "INFER_WORKER_KAFKA__CONTROL_TOPIC": ctl}
    rng = np.random.default_rng(9)
    rows = {p: {f"{p}-{i}": rng.normal(size=4).astype(np.float32) for i in range(8)}
            for p in ("before", "after")}  # fmt: skip
    offsets: dict[str, int] = {}
    cli_env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}

    def load(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "worker", "models", "load", "scorer", "--version", "1",
                   *args, "--config", str(config)]  # fmt: skip
        return subprocess.run(command, env=cli_env, capture_output=True, text=True, timeout=60,
                              check=False)  # fmt: skip

    worker = spawn_worker(broker.bootstrap, input_topics=[topic], output_topic=names["results"],
                          dlq_topic=names["dlq"], group_id=names["group"],
                          extra_env=env)  # fmt: skip
    try:
        await asyncio.to_thread(worker.wait_until,
                                lambda m: m.get("infer_assigned_partitions", 0) >= 1, 90.0,
                                "assignment")  # fmt: skip
        before = await _answers(broker, topic, names["results"], "before", rows["before"],
                                offsets)  # fmt: skip
        # Refused before anything is written, naming the key.
        bad = await asyncio.to_thread(load, "--settings", '{"topics": ["elsewhere"]}')
        assert bad.returncode == 2 and "settings.topics: 'scorer' answers" in bad.stderr, (
            bad.stderr)  # fmt: skip
        assert "may give a served model more topics, never take one away" in bad.stderr
        torch = {"parameters": {"version": 1, "settings": {"backend": "torch"}}}
        code, body = _post(worker.metrics_port, "/v2/repository/models/scorer/load", torch)
        assert code == 400 and "parameters.settings.backend" in body["error"], body
        wider = json.dumps({"outputs": ["score", "probabilities"]})
        done = await asyncio.to_thread(load, "--settings", wider)
        assert done.returncode == 0, done.stderr
        await asyncio.to_thread(worker.wait_until, lambda m: _swaps(worker, "swapped") >= 1,
                                60.0, "the settings swapped in")  # fmt: skip
        after = await _answers(broker, topic, names["results"], "after", rows["after"], offsets)
        assert _swaps(worker, "refused") == 0
        # models list reads the topic back: each model's desired state as applied.
        listed = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "worker", "models", "list", "--config", str(config)],
            env=cli_env, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert f"{ctl}: 1 model(s) set:" in listed.stdout, listed.stdout
        assert f"  scorer  version 1 with settings {wider}" in listed.stdout, listed.stdout
    finally:
        code = worker.terminate()
    assert code == 0, worker.log_tail()
    for phase, got in (("before", before), ("after", after)):
        for rid, r in got.items():
            assert r.status == "ok", (rid, r.error)
            alone = run_alone(model, {"features": rows[phase][rid]})
            want = {"score"} if phase == "before" else {"score", "probabilities"}
            assert set(r.outputs) == want, (rid, set(r.outputs))
            for name in want:
                np.testing.assert_allclose(r.outputs[name].to_numpy(), alone[name], rtol=1e-5,
                                           atol=1e-6)  # fmt: skip
