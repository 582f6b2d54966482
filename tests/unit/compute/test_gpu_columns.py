"""The GPU stage's columns path (``worker.compute.gpu.columns``), on its CPU twin:
a step's rows as whole arrays in, device arrays out; a device input copied
device to device into the slot, a host one through its pinned twin; what runs
so decided once; the outputs equal the CPU stage's answers to the same rows."""

from __future__ import annotations

import time

import numpy as np

from tests.gpu.support import gpu_stage, make_jobs, queues
from tests.models import cpu_stage
from worker.compute.engines import load_engine
from worker.compute.gpu.ops import TRANSFERS
from worker.compute.gpu.stage import GpuStage
from worker.compute.gpu.twin import cupy_for
from worker.config import BatchingConfig, GpuConfig, ModelConfig
from worker.config.model import PostprocessConfig, PreprocessConfig
from worker.flow.messages import Batch

POST = PostprocessConfig(top_k=3, include_raw=True)


def _stage(model: ModelConfig, max_input_bytes: int = 1 << 20) -> GpuStage:
    engine = load_engine(model, max_batch_size=8)
    source, sink = queues()
    stage: GpuStage = gpu_stage(source, sink, engine, model, 8, 2,
                                GpuConfig(max_input_bytes=max_input_bytes),
                                batching=BatchingConfig(), cupy=cupy_for("gpu-twin"))  # fmt: skip
    return stage


def test_what_runs_as_device_columns_is_decided_once() -> None:
    gpu = _stage(ModelConfig(path="builtin:digits", backend="gpu-twin", postprocess=POST,
                             preprocess=PreprocessConfig(device="gpu")))  # fmt: skip
    cpu = _stage(ModelConfig(path="builtin:digits", backend="gpu-twin", postprocess=POST,
                             preprocess=PreprocessConfig(device="cpu")))  # fmt: skip
    text = _stage(ModelConfig(path="builtin:sentiment", backend="gpu-twin"))
    try:
        assert gpu.device_columnar  # the image the kernels preprocess, top-k on the device
        assert not cpu.device_columnar  # preprocessed on the host, per request
        assert not text.device_columnar  # tokens of a free length
    finally:
        for s in (gpu, cpu, text):
            s.close()


async def test_device_and_host_columns_answer_as_the_cpu_stage() -> None:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (21, 12, 10, 1), dtype=np.uint8)
    twin = cupy_for("gpu-twin")
    on_device = twin.empty(pixels.shape, np.uint8)
    on_device[...] = pixels
    # 8 images of 120 bytes a run: 3 runs on one slot, each at its rows of the outputs.
    stage = _stage(ModelConfig(path="builtin:digits", backend="gpu-twin", postprocess=POST,
                               preprocess=PreprocessConfig(device="gpu")), 1000)  # fmt: skip
    try:
        TRANSFERS.reset()
        from_device = await stage.run_device_columns({"image": on_device})
        copies, uploads = TRANSFERS.device_copies, TRANSFERS.uploads
        TRANSFERS.reset()
        from_host = await stage.run_device_columns({"image": pixels})
        host_uploads = TRANSFERS.uploads
        refused = await stage.run_device_columns({"image": pixels.astype(np.float32)})
        assert all(s.pending is None for s in stage.slots)  # each slot back in the ring
        assert stage.ring.free == len(stage.slots)
    finally:
        stage.close()
    assert (copies, uploads) == (3, 0) and host_uploads == 3  # one copy in a run
    assert refused is None  # not what the model takes: the caller runs it as jobs
    assert from_device is not None and from_host is not None
    cpu = cpu_stage(ModelConfig(path="builtin:digits", postprocess=POST), max_batch_size=64)
    want = await cpu.run_batch(Batch(make_jobs(list(pixels)), time.monotonic(), "full"))
    cpu.close()
    assert set(from_device) == {"logits", "topk_indices", "topk_scores"}
    for name, column in from_device.items():
        assert twin.is_device(column) and twin.is_device(from_host[name])
        np.testing.assert_array_equal(column, from_host[name])
        rows = np.stack([a.outputs[name] for a in want.answers if a.outputs is not None])
        np.testing.assert_allclose(column, rows, rtol=1e-5, atol=1e-6)
