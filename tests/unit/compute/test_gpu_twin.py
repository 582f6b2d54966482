"""The GPU stage on its CPU twin (``model.backend = "gpu-twin"``): the stage's own
code (slots, ring, collation into pinned twins, copies by address, chunking,
the kernels' launch wrappers, device postprocessing, the memory share) runs a
real ONNX model, and every answer equals the CPU stage's on the same file.
A GPU runs the same code on CuPy (tests/gpu)."""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import gpu_stage, make_jobs, queues, run_stage
from tests.gpu.support import request_jobs as jobs
from tests.models import cpu_stage
from worker.compute.engines import load_engine
from worker.compute.gpu import twin
from worker.compute.gpu.budget import DeviceShare
from worker.compute.gpu.twin import cupy_for
from worker.config import BatchingConfig, GpuConfig, LimitsConfig, ModelConfig
from worker.config.model import PostprocessConfig, PreprocessConfig
from worker.flow.errors import ConfigError
from worker.flow.messages import Batch, Completed
from worker.model.inputs import bind
from worker.ops.samples import sentiment_samples


def _answers(done: list[Completed] | Completed) -> list[Any]:
    return [a for c in (done if isinstance(done, list) else [done]) for a in c.answers]


def _equal(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.outputs is not None and w.outputs is not None, (g.failure, w.failure)
        assert set(g.outputs) == set(w.outputs)
        for name in w.outputs:
            np.testing.assert_allclose(g.outputs[name], w.outputs[name], rtol=1e-5, atol=1e-6)


def _batches(all_jobs: list[Any], *sizes: int) -> list[Batch[Any]]:
    out, start = [], 0
    for i, size in enumerate(sizes):
        out.append(Batch(all_jobs[start : start + size], time.monotonic(), "full", i + 1))
        start += size
    return out


async def test_a_text_model_with_a_free_dimension_equals_the_cpu_stage() -> None:
    """Texts tokenized on the stage's threads, collated at each group's length
    bucket into the slot's pinned twins, copied in by address, outputs cut back
    to each request's length: as the CPU stage answers."""
    requests: list[dict[str, Any]] = [{"text": s.text} for s in sentiment_samples()[:90]]
    model = ModelConfig(path="builtin:sentiment", backend="gpu-twin")
    engine = load_engine(model, max_batch_size=64)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 64, 2, batching=BatchingConfig(),
                      cupy=cupy_for("gpu-twin"))  # fmt: skip
    try:
        inputs = bind(model, engine.info.io, LimitsConfig(), BatchingConfig())
        got = await run_stage(stage, source, sink, _batches(jobs(inputs, requests), 50, 40))
    finally:
        stage.close()
    cpu_model = ModelConfig(path="builtin:sentiment")
    cpu = cpu_stage(cpu_model)
    want = await cpu.run_batch(
        Batch(
            jobs(bind(cpu_model, cpu.info.io, LimitsConfig()), requests), time.monotonic(), "full"
        )
    )
    cpu.close()
    _equal(_answers(got), _answers(want))


@pytest.mark.parametrize("device", ["gpu", "cpu"])
async def test_images_preprocessed_by_the_kernels_and_top_k_on_the_device(device: str) -> None:
    """``device = "gpu"``: the images packed into the slot's staging, resized and
    normalised by the preprocess kernel's reference, top-k by the postprocess
    kernel's; ``"cpu"``: preprocessed on the host into the pinned twin. Images of
    many sizes; batches larger than the engine's maximum run in chunks."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(int(rng.integers(6, 40)), int(rng.integers(6, 40)), 1),
                           dtype=np.uint8) for _ in range(70)]  # fmt: skip
    post = PostprocessConfig(top_k=3)
    model = ModelConfig(path="builtin:digits", backend="gpu-twin",
                        preprocess=PreprocessConfig(device=device), postprocess=post)  # fmt: skip
    engine = load_engine(model, max_batch_size=32)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 32, 2, cupy=cupy_for("gpu-twin"))
    try:
        got = await run_stage(stage, source, sink, _batches(make_jobs(images), 40, 30))
    finally:
        stage.close()
    cpu = cpu_stage(ModelConfig(path="builtin:digits", postprocess=post), max_batch_size=70)
    want = await cpu.run_batch(Batch(make_jobs(images), time.monotonic(), "full"))
    cpu.close()
    _equal(_answers(got), _answers(want))
    assert all(set(a.outputs) == {"topk_indices", "topk_scores"} for a in _answers(got))


async def test_the_slots_are_the_twin_devices_memory_while_they_live() -> None:
    """Every slot buffer is allocated once, from the twin's pool (what the memory
    share measures), and given back when the stage closes."""
    pool = twin.cupy().get_default_memory_pool()
    gc.collect()
    before = pool.total_bytes()
    model = ModelConfig(path="builtin:digits", backend="gpu-twin",
                        preprocess=PreprocessConfig(device="gpu"))  # fmt: skip
    engine = load_engine(model, max_batch_size=16)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 16, 3, GpuConfig(max_input_bytes=1 << 20),
                      cupy=cupy_for("gpu-twin"))  # fmt: skip
    held = pool.total_bytes() - before
    assert held == stage.layout.device_bytes * 3
    count = stage.allocations.count
    await run_stage(stage, source, sink, _batches(make_jobs([np.zeros((9, 9, 1), np.uint8)] * 20),
                                                  20))  # fmt: skip
    assert stage.allocations.count == count  # nothing allocated per batch
    stage.close()
    del stage
    gc.collect()
    assert pool.total_bytes() == before


def test_several_models_rings_are_checked_together_against_the_share() -> None:
    """One share of the device per process; each model's ring is checked beside
    the rings of the models started before it, and the refusal names them."""
    cupy = twin.make()
    share = DeviceShare(0, 1 / 1024, torch_engine=False, cupy=cupy)  # 16 MiB of 16 GiB
    share.slots_for("first").check_slots(2 * 2**20, 2)  # 4 MiB: within half the share
    with pytest.raises(ConfigError, match=r"beside first 4 MiB"):
        share.slots_for("second").check_slots(2 * 2**20, 3)  # 4 + 6 > 8 MiB
    share.slots_for("second").check_slots(2 * 2**20, 2)  # 4 + 4: fits
    assert share.rings == {"first": 4 * 2**20, "second": 4 * 2**20}


def test_what_each_model_takes_is_measured_and_capped_by_the_share() -> None:
    """Each model's stage measured as it starts; the share caps the pool, so a
    model that would take more fails as it allocates, not later."""
    cupy = twin.make()
    share = DeviceShare(0, 1 / 1024, torch_engine=False, cupy=cupy)  # 16 MiB
    kept = [share.measure("a", lambda: cupy.zeros(6 * 2**20, np.uint8))]
    kept.append(share.measure("b", lambda: cupy.zeros(5 * 2**20, np.uint8)))
    assert share.models == {"a": 6 * 2**20, "b": 5 * 2**20}
    share.check_used()  # 11 MiB of 16
    with pytest.raises(twin.OutOfMemoryError):
        share.measure("c", lambda: cupy.zeros(6 * 2**20, np.uint8))
    with pytest.raises(ConfigError, match=r"holds 17 MiB \(a 6 MiB, b 5 MiB, c 6 MiB\)"):
        share.budget.check_used(17 * 2**20, {"a": 6 * 2**20, "b": 5 * 2**20, "c": 6 * 2**20})


def test_the_twin_pool_refuses_past_its_limit_as_cupys_does() -> None:
    cupy = twin.make()
    cupy.get_default_memory_pool().set_limit(size=1000)
    cupy.zeros(600, np.uint8)  # freed at once (no reference kept)
    kept = cupy.zeros(900, np.uint8)
    with pytest.raises(twin.OutOfMemoryError):
        cupy.zeros(200, np.uint8)
    assert kept.nbytes == 900
