"""GPU models loaded by demand (``repository.on_demand`` with
``limits.max_gpu_models_memory_mb``), on the GPU stage's CPU twin: the worker
built as ``run`` and ``config`` build it (``Worker.prepare``: no Kafka), three
repository models of the bundled digits on ``gpu-twin``, their images
preprocessed on the device. At start-up every stage starts and is measured,
then those over the device's budget are evicted, oldest first; a batch of an
evicted model loads it (its stage's slots and engine built again), evicting the
least recently used; the answers equal those before any eviction and the
device memory held never exceeds the budget. A real GPU's CUDA graphs and
TensorRT contexts are only rebuilt on a GPU (tests/gpu); the twin has neither."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import make_jobs
from worker.app.memory import MIB
from worker.app.worker import Worker
from worker.compute.stage import Stage
from worker.config import load_settings
from worker.flow.errors import ConfigError
from worker.flow.messages import Batch
from worker.model.files import bundled_file
from worker.obs import metrics

MODELS = ("a", "b", "c")


def _repository(root: Path) -> Path:
    for name in MODELS:
        (root / name / "1").mkdir(parents=True)
        shutil.copy(bundled_file("digits.onnx"), root / name / "1" / "model.onnx")
        (root / name / "model.toml").write_text(
            f'topics = ["in.{name}"]\nbackend = "gpu-twin"\n'
            '[preprocess]\ndevice = "gpu"\n[postprocess]\ntop_k = 3\n')  # fmt: skip
    return root


def _worker(repo: Path, budget_mb: int, pinned: str = "") -> Worker:
    env = {"INFER_WORKER_REPOSITORY__PATH": str(repo),
           "INFER_WORKER_REPOSITORY__ON_DEMAND": "true",
           "INFER_WORKER_REPOSITORY__PINNED": pinned,
           "INFER_WORKER_LIMITS__MAX_GPU_MODELS_MEMORY_MB": str(budget_mb),
           "INFER_WORKER_KAFKA__INPUT_TOPICS": ",".join(f"in.{m}" for m in MODELS),
           "INFER_WORKER_GPU__NUM_SLOTS": "2",
           "INFER_WORKER_GPU__MAX_INPUT_BYTES": str(4 << 20)}  # fmt: skip
    return Worker(load_settings(env={k: v for k, v in env.items() if v}))


async def _answer(stage: Stage, seq: int) -> list[Any]:
    rng = np.random.default_rng(seq % 3)
    images = [rng.integers(0, 256, size=(20, 24, 1), dtype=np.uint8) for _ in range(12)]
    done = await stage.run_batch(Batch(make_jobs(images), time.monotonic(), "full", seq))
    return [(a.error, {k: np.asarray(v) for k, v in (a.outputs or {}).items()})
            for a in done.answers]  # fmt: skip


async def test_gpu_models_share_the_device_s_budget_by_demand(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "models")
    # What each model's stage takes of the device, as the worker measures it.
    probe = _worker(repo, 0)
    stages = await probe.prepare()
    sizes = dict(stages.device_memory)
    want = {m.name: await _answer(m.infer, i) for i, m in enumerate(stages.models)}
    await probe.stop()
    assert set(sizes) == set(MODELS) and min(sizes.values()) > MIB

    budget_mb = int((max(sizes.values()) + (repo / "a" / "1" / "model.onnx").stat().st_size)
                    * 2.5 / MIB)  # two of the three (a model counts its stage and weights)
    evictions = metrics.MODEL_EVICTIONS.labels("a", "room")._value.get()
    loads = metrics.MODEL_LOADS.labels("a", "demand")._value.get()
    worker = _worker(repo, budget_mb)
    stages = await worker.prepare()
    try:
        residency = worker._residency
        assert residency is not None
        weights = (repo / "a" / "1" / "model.onnx").stat().st_size
        assert {r.name: r.size for r in residency.residents} == {
            name: size + weights for name, size in sizes.items()}  # its stage and its weights
        loaded = {r.name for r in residency.residents if r.loaded}
        assert loaded == {"b", "c"}  # the oldest evicted at start-up
        assert residency.used(True) <= budget_mb * MIB
        by_name = {m.name: m.infer for m in stages.models}
        for round_ in range(2):  # a, b, c, a, b, c: each round reloads what was evicted
            for i, name in enumerate(MODELS):
                got = await _answer(by_name[name], i)
                for (err, out), (_, expected) in zip(got, want[name], strict=True):
                    assert err is None, err
                    for key, value in expected.items():
                        np.testing.assert_array_equal(out[key], value)
                assert residency.used(True) <= budget_mb * MIB
                assert metrics.GPU_MODELS_MEMORY_USED._value.get() <= budget_mb * MIB
                assert len([r for r in residency.residents if r.loaded]) == 2, round_
        # a: evicted at start-up, loaded by its batch, evicted again by c's, loaded again.
        assert metrics.MODEL_EVICTIONS.labels("a", "room")._value.get() - evictions >= 1
        assert metrics.MODEL_LOADS.labels("a", "demand")._value.get() - loads == 2
    finally:
        await worker.stop()


async def test_a_gpu_model_that_cannot_fit_the_device_s_budget_stops_start_up(
    tmp_path: Path,
) -> None:
    repo = _repository(tmp_path / "models")
    worker = _worker(repo, 1)
    with pytest.raises(ConfigError, match=r"limits\.max_gpu_models_memory_mb: 'a' takes \d+ "
                       r"MiB of the device, which does not fit the budget of 1 MiB"):  # fmt: skip
        await worker.prepare()
    await worker.stop()
