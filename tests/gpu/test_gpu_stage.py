"""GpuStage on a GPU with small CuPy engines (no torch or TensorRT needed).

- results equal the NumPy pipeline (preprocess -> x @ w + b -> postprocess);
- slot buffers are allocated once and never again (counter, pointers, CuPy pool);
- two batches are on the device at once, on different streams (CUDA timestamps);
- a failed batch is answered ``inference_failed`` and the stage goes on; an
  engine-dead error fails the batch's future and stops the stage;
- expired requests get no device time; a batch larger than the staging buffer is
  split; an image larger than it is ``too_large``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import gpu_stage
from worker.config import GpuConfig, ModelConfig, PostprocessConfig, PreprocessConfig
from worker.flow.errors import EngineDead, InferenceFailed
from worker.flow.messages import Completed
from worker.model.inputs.image import resolve_declared
from worker.model.postprocess import postprocess
from worker.model.preprocess import preprocess

from .support import LinearEngine, SpinEngine, batches_of, make_jobs, queues, run_stage

pytestmark = pytest.mark.gpu

SCORE_ATOL = 1e-5  # float32 sums in a different order than NumPy's matmul

RGB = ModelConfig(
    name="linear",
    path="unused",
    output="logits",
    backend="torch",  # any GPU backend: the tests hand the stage their own engine
    preprocess=PreprocessConfig(
        size=(16, 12),
        channels=3,
        mean=(0.4, 0.5, 0.6),
        std=(0.2, 0.3, 0.25),
        layout="NHWC",
        device="gpu",
    ),
    postprocess=PostprocessConfig(softmax=True, top_k=5, include_raw=True),
)


def _engine(model: ModelConfig, classes: int = 20, seed: int = 0) -> LinearEngine:
    pp = model.preprocess
    row = (pp.size[0], pp.size[1], pp.channels) if pp.layout == "NHWC" else (pp.channels, *pp.size)
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (int(np.prod(row)), classes)).astype(np.float32)
    b = rng.normal(0, 0.1, classes).astype(np.float32)
    return LinearEngine(w, b, row)


def _images(n: int, channels: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 90, (n, 2))]
    return [rng.integers(0, 256, (h, w, channels), dtype=np.uint8) for h, w in sizes]


def _reference(
    engine: LinearEngine, model: ModelConfig, images: list[np.ndarray]
) -> dict[str, Any]:
    x = preprocess(images, resolve_declared(model.preprocess, "the test model"))
    raw = engine.run(x)["logits"]
    return postprocess(raw, model.postprocess, "logits")


def _check_against_reference(
    completed: list[Completed], engine: LinearEngine, model: ModelConfig, images: list[np.ndarray]
) -> None:
    want = _reference(engine, model, images)
    answers = [a for c in completed for a in c.answers]
    assert [a.job.offset for a in answers] == list(range(len(images)))  # dispatch order
    for i, answer in enumerate(answers):
        assert answer.error is None, answer.error
        assert answer.outputs is not None
        assert set(answer.outputs) == set(want)
        assert np.array_equal(answer.outputs["topk_indices"], want["topk_indices"][i])
        np.testing.assert_allclose(
            answer.outputs["topk_scores"], want["topk_scores"][i], atol=SCORE_ATOL
        )
        np.testing.assert_allclose(answer.outputs["logits"], want["logits"][i], atol=SCORE_ATOL)
        assert {"queue", "preprocess", "infer", "d2h"} <= set(answer.timing_us)


@pytest.mark.parametrize("preprocess_on", ["gpu", "cpu"])
async def test_stage_equals_the_numpy_pipeline(cp: Any, preprocess_on: str) -> None:
    engine = _engine(RGB)
    images = _images(70, 3)
    source, sink = queues()
    model = dataclasses.replace(
        RGB, preprocess=dataclasses.replace(RGB.preprocess, device=preprocess_on)
    )
    stage = gpu_stage(source, sink, engine, model, 16, 3)
    try:
        jobs = make_jobs(images)
        completed = await run_stage(stage, source, sink, batches_of(jobs, [1, 16, 7, 16, 3]))
    finally:
        stage.close()
    _check_against_reference(completed, engine, RGB, images)
    # Slots run concurrently, so the engine may see the batches in any order.
    assert sorted(engine.enqueued) == sorted([1, 16, 7, 16, 3, 1, 16, 7, 3])


async def test_probabilities_without_topk(cp: Any) -> None:
    model = dataclasses.replace(RGB, postprocess=PostprocessConfig(softmax=True, top_k=0))
    engine = _engine(model)
    images = _images(9, 3, seed=4)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 8, 2)
    try:
        completed = await run_stage(stage, source, sink, batches_of(make_jobs(images), [8]))
    finally:
        stage.close()
    want = _reference(engine, model, images)
    got = np.stack([a.outputs["probabilities"] for c in completed for a in c.answers])  # type: ignore[index]
    np.testing.assert_allclose(got, want["probabilities"], rtol=1e-5, atol=1e-6)


async def test_slot_buffers_are_never_reallocated(cp: Any) -> None:
    engine = _engine(RGB)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, RGB, 8, 2, GpuConfig(max_input_bytes=1 << 20))

    def pointers() -> list[int]:
        out = []
        for slot in stage.slots:
            out.append(int(slot.engine_inputs["image"].data.ptr))
            out += [int(a.data.ptr) for a in slot.engine_outputs.values()]
            out += [int(a.data.ptr) for a in slot.results.values()]
            out += [int(slot.dev_packed.data.ptr), int(slot.dev_table.data.ptr)]
            out += [int(a.ctypes.data) for a in slot.host_results.values()]
            out += [int(slot.host_packed.ctypes.data), int(slot.host_table.ctypes.data)]  # type: ignore[union-attr]
        return out

    pool = cp.get_default_memory_pool()
    try:
        # One warm-up batch: first launches may allocate (module load, not slots).
        await run_stage(stage, source, sink, batches_of(make_jobs(_images(3, 3)), [3]))
        count, nbytes, ptrs = stage.allocations.count, stage.allocations.nbytes, pointers()
        # Garbage from earlier tests (CuPy arrays in reference cycles) must not be
        # freed by the cyclic GC inside the measured window and move the pool.
        gc.collect()
        used, total = pool.used_bytes(), pool.total_bytes()
        # The same stage and queues, a second stream of batches.
        images = _images(40, 3, seed=9)
        completed = await run_stage(stage, source, sink, batches_of(make_jobs(images), [8, 1, 5]))
        assert len(completed) == 9  # 8, 1, 5, 8, 1, 5, 8, 1, 3
        assert (stage.allocations.count, stage.allocations.nbytes) == (count, nbytes)
        assert pointers() == ptrs
        assert (pool.used_bytes(), pool.total_bytes()) == (used, total)
        # Per slot: input, logits, 2 top-k results, 3 pinned twins (logits, top-k), and
        # packed bytes + table, each pinned and on the device.
        assert count == 2 * 11
    finally:
        stage.close()


async def test_two_batches_run_at_once_on_different_streams(cp: Any) -> None:
    spin_s = 0.2
    engine = SpinEngine(spin_s)
    # input: the classifier shorthand, so "image" is an image (a tensor otherwise).
    model = ModelConfig(name="spin", path="unused", output="logits", input="image")
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 8, 2, GpuConfig(max_input_bytes=1 << 16))
    try:
        # Warm-up: every kernel launched once on both slots (CUDA loads kernels lazily,
        # which can serialise the very first launches).
        engine.seconds = 0.0
        await run_stage(stage, source, sink, batches_of(make_jobs(_images(4, 1)), [2, 2]))
        engine.seconds = spin_s
        jobs = make_jobs(_images(4, 1))
        completed = await run_stage(stage, source, sink, batches_of(jobs, [2, 2]))
        a, b = (slot.context for slot in stage.slots)
        assert stage.slots[0].stream.ptr != stage.slots[1].stream.ptr
        elapsed = cp.cuda.get_elapsed_time  # milliseconds between two recorded events
        a_end = elapsed(a.start, a.end)
        b_start, b_end = elapsed(a.start, b.start), elapsed(a.start, b.end)
        assert a_end >= spin_s * 1e3 * 0.9
        overlap = min(a_end, b_end) - max(0.0, b_start)
        assert overlap > 0.5 * spin_s * 1e3, (
            f"batch A ran 0..{a_end:.1f} ms, batch B {b_start:.1f}..{b_end:.1f} ms: no overlap"
        )
    finally:
        stage.close()
    assert all(a.error is None for c in completed for a in c.answers)


async def test_failed_batch_is_answered_and_the_stage_goes_on(cp: Any) -> None:
    engine = _engine(RGB)
    # One slot runs the batches in order. With max_attempts=1 the first batch takes
    # 1 + 2 + 4 failing runs (the whole batch, its halves, each request alone).
    engine.fail_runs = 7
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, RGB, 4, 1, max_attempts=1)
    try:
        images = _images(8, 3)
        completed = await run_stage(stage, source, sink, batches_of(make_jobs(images), [4]))
    finally:
        stage.close()
    first, second = completed
    assert all(
        a.error is not None and a.error.code == "inference_failed" and a.outputs is None
        for a in first.answers
    )
    assert all(a.error is None and a.outputs is not None for a in second.answers)


async def test_isolation_reruns_subsets_on_the_slot(cp: Any) -> None:
    engine = _engine(RGB)
    engine.fail_next = InferenceFailed("transient")
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, RGB, 4, 2, max_attempts=2)
    try:
        images = _images(4, 3)
        completed = await run_stage(stage, source, sink, batches_of(make_jobs(images), [4]))
    finally:
        stage.close()
    _check_against_reference(completed, engine, RGB, images)  # the halves succeeded
    assert engine.enqueued == [2, 2]


async def test_engine_dead_fails_the_batch_and_stops_the_stage(cp: Any) -> None:
    engine = _engine(RGB)
    engine.fail_next = EngineDead("device lost")
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, RGB, 4, 1)  # the 2nd batch waits for the slot
    jobs = make_jobs(_images(8, 3))
    for batch in batches_of(jobs, [4]):
        source.put_nowait(batch)
    source.put_nowait(None)
    try:
        run = asyncio.create_task(stage.run())
        first = await sink.get()
        assert first is not None
        with pytest.raises(EngineDead, match="device lost"):
            await first
        with pytest.raises(EngineDead):
            await run
    finally:
        stage.close()


async def test_expired_requests_spend_no_device_time(cp: Any) -> None:
    engine = _engine(RGB)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, RGB, 4, 2)
    try:
        jobs = make_jobs(_images(3, 3), deadline=0.0)  # long past
        completed = await run_stage(stage, source, sink, batches_of(jobs, [3]))
    finally:
        stage.close()
    assert [a.error.code for a in completed[0].answers] == ["deadline_exceeded"] * 3  # type: ignore[union-attr]
    assert completed[0].engine_rows == 0 and engine.enqueued == []


async def test_batches_larger_than_staging_are_split_and_huge_images_rejected(cp: Any) -> None:
    engine = _engine(RGB)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, RGB, 8, 2, GpuConfig(max_input_bytes=40_000))
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, (60, 80, 3), dtype=np.uint8) for _ in range(8)]  # 14.4 kB each
    huge = rng.integers(0, 256, (200, 100, 3), dtype=np.uint8)  # 60 kB
    try:
        jobs = make_jobs([*images, huge])
        completed = await run_stage(stage, source, sink, batches_of(jobs, [9]))
    finally:
        stage.close()
    answers = completed[0].answers
    assert answers[8].error is not None and answers[8].error.code == "too_large"
    assert engine.enqueued == [2, 2, 2, 2]  # 40 kB holds two 14.4 kB images
    _check_against_reference(
        [Completed(seq=1, answers=answers[:8], engine_rows=8)], engine, RGB, images
    )


async def test_nvml_gauges_report_the_device() -> None:
    """The monitor publishes the CUDA device's memory and utilisation (NVML),
    labelled with the device's uuid (one series per physical device however many
    processes publish it), and this process's own memory on it."""
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (gpu extra)")
    import cupy
    from prometheus_client import REGISTRY

    from worker.compute.gpu.monitor import NvmlDevice, watch_gpu

    cupy.zeros(2**20, dtype=cupy.uint8)  # this process holds device memory
    nvml = NvmlDevice(0)
    labels = {"device": "0", "uuid": nvml.uuid}
    nvml.close()
    assert labels["uuid"].startswith("GPU-")
    task = asyncio.create_task(watch_gpu(0, interval=0.05))
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            total = REGISTRY.get_sample_value("infer_gpu_memory_total_bytes", labels)
            if total:
                break
    finally:
        task.cancel()
    assert total is not None and total > 2**30
    used = REGISTRY.get_sample_value("infer_gpu_memory_used_bytes", labels)
    util = REGISTRY.get_sample_value("infer_gpu_utilization_ratio", labels)
    mine = REGISTRY.get_sample_value("infer_gpu_process_memory_bytes", labels)
    assert used is not None and 0 < used <= total
    # Unset where NVML lists processes by pids of another namespace (containers).
    assert mine is None or 0 < mine <= used
    assert util is not None and 0.0 <= util <= 1.0
