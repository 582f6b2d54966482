"""The GPU pipeline end to end with the torch engine, against the CPU pipeline.

The bundled digits model (worker/model/bundled/digits.onnx: Flatten -> Gemm -> Relu ->
Gemm) is rebuilt as a TorchScript MLP from the ONNX file's own initializers, so
both pipelines run the same weights: the CPU ``CpuStage`` with ONNX Runtime
and the ``GpuStage`` with ``TorchEngine`` (GPU preprocessing, the model
on the slot's stream through DLPack views, top-k on device).

Tolerance: top-1 must be identical on every held-out sample (the preprocessing
is bit-identical, and float32 GEMMs differ by ~1e-6, far below any logit gap
among the samples); top-k scores (probabilities) within ``atol = 1e-5``. TF32 is
switched off so the GPU GEMM really is float32.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import gpu_stage
from tests.models import cpu_stage
from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
from worker.config import ModelConfig, PreprocessConfig
from worker.flow.messages import Completed
from worker.model.files import bundled_file, resolve_model_path
from worker.model.inputs.image import resolve_declared
from worker.model.preprocess import preprocess

from .support import batches_of, make_jobs, queues, run_stage

pytestmark = [pytest.mark.gpu, pytest.mark.needs_torch]

SCORE_ATOL = 1e-5
SAMPLES = Path(str(bundled_file("digits_samples.npz")))


@pytest.fixture(scope="module")
def samples() -> tuple[list[np.ndarray], np.ndarray]:
    with np.load(SAMPLES) as npz:
        return list(npz["images"]), np.asarray(npz["labels"])


# The digits model's 8x8 grey input: a TorchScript file does not declare it.
DIGITS_PP = PreprocessConfig(size=(8, 8), channels=1)


def _torch_model(path: Path) -> ModelConfig:
    """A TorchScript file's one output is named by model.output; an exported
    program names its own (``output``)."""
    output = "logits" if path.suffix == ".pt" else None
    return ModelConfig(name="digits", path=str(path), backend="torch", output=output,
                       preprocess=DIGITS_PP)  # fmt: skip


def test_torch_engine_run_matches_onnxruntime(
    torch: Any, digits_torchscript: Path, samples: tuple[list[np.ndarray], np.ndarray]
) -> None:
    from worker.compute.engines.torch import TorchEngine

    images, _ = samples
    cpu_cfg = ModelConfig()
    x = preprocess(images[:64], resolve_declared(DIGITS_PP, "the digits model"))
    cpu = OnnxRuntimeEngine(resolve_model_path(cpu_cfg.path), cpu_cfg)
    gpu = TorchEngine(digits_torchscript, _torch_model(digits_torchscript), max_batch_size=64)
    try:
        assert gpu.info.output_names == ("logits",)
        assert gpu.outputs[0].shape == (10,) and gpu.inputs[0].shape == (1, 8, 8)
        np.testing.assert_allclose(
            gpu.run({"input": x})["logits"], cpu.run({"image": x})["logits"], atol=1e-4
        )
    finally:
        gpu.close()
        cpu.close()


async def _cpu_results(images: list[np.ndarray], sizes: list[int]) -> list[Completed]:
    cfg = ModelConfig()
    engine = OnnxRuntimeEngine(resolve_model_path(cfg.path), cfg)
    source, sink = queues()
    stage = cpu_stage(cfg, engine, batches_in=source, completed_out=sink, max_inflight=2)
    try:
        return await run_stage(stage, source, sink, batches_of(make_jobs(images), sizes))
    finally:
        stage.close()
        engine.close()


async def _gpu_results(
    path: Path, images: list[np.ndarray], sizes: list[int], preprocess_on: str
) -> list[Completed]:
    from worker.compute.engines.torch import TorchEngine

    model = _torch_model(path)
    model = dataclasses.replace(
        model, preprocess=dataclasses.replace(model.preprocess, device=preprocess_on)
    )
    engine = TorchEngine(path, model, max_batch_size=64)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 64, 3)
    try:
        return await run_stage(stage, source, sink, batches_of(make_jobs(images), sizes))
    finally:
        stage.close()
        engine.close()


@pytest.mark.parametrize("preprocess_on", ["gpu", "cpu"])
async def test_gpu_stage_with_torch_equals_cpu_stage(
    torch: Any,
    digits_torchscript: Path,
    samples: tuple[list[np.ndarray], np.ndarray],
    preprocess_on: str,
) -> None:
    images, labels = samples
    sizes = [1, 64, 17, 64, 33]  # batch of 1, of max, and odd ones
    cpu = [a for c in await _cpu_results(images, sizes) for a in c.answers]
    gpu = [
        a for c in await _gpu_results(digits_torchscript, images, sizes, preprocess_on)
        for a in c.answers
    ]  # fmt: skip
    assert len(cpu) == len(gpu) == len(images)
    for i, (c, g) in enumerate(zip(cpu, gpu, strict=True)):
        assert c.error is None and g.error is None, (i, c.error, g.error)
        assert c.outputs is not None and g.outputs is not None
        assert set(g.outputs) == set(c.outputs) == {"topk_indices", "topk_scores"}
        assert g.outputs["topk_indices"][0] == c.outputs["topk_indices"][0], f"sample {i}"
        assert g.outputs["topk_scores"].dtype == np.float32
        assert g.outputs["topk_indices"].dtype == np.int64
        np.testing.assert_allclose(
            g.outputs["topk_scores"], c.outputs["topk_scores"], atol=SCORE_ATOL
        )
    top1 = np.array([g.outputs["topk_indices"][0] for g in gpu])  # type: ignore[index]
    assert np.mean(top1 == labels) >= 0.97  # the recorded held-out accuracy is 0.975


async def test_resized_inputs_agree_with_cpu(
    torch: Any, digits_torchscript: Path, samples: tuple[list[np.ndarray], np.ndarray]
) -> None:
    """Requests of other sizes than the model's (resized on the device) still give the
    CPU pipeline's answers."""
    images, _ = samples
    rng = np.random.default_rng(11)
    resized = []
    for img in images[:96]:
        k = int(rng.integers(1, 5))
        big = np.kron(img, np.ones((k, k + 1, 1), dtype=np.uint8))  # odd aspect ratios
        resized.append(np.ascontiguousarray(big))
    cpu = [a for c in await _cpu_results(resized, [32]) for a in c.answers]
    gpu = [
        a for c in await _gpu_results(digits_torchscript, resized, [32], "gpu") for a in c.answers
    ]
    for c, g in zip(cpu, gpu, strict=True):
        assert c.outputs is not None and g.outputs is not None
        assert g.outputs["topk_indices"][0] == c.outputs["topk_indices"][0]
        np.testing.assert_allclose(
            g.outputs["topk_scores"], c.outputs["topk_scores"], atol=SCORE_ATOL
        )


# --- the compiled path: exported program, buckets, warm-up, CUDA graphs -------------


@pytest.fixture(scope="module")
def digits_program(
    torch: Any, digits_torchscript: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The same MLP as an exported program with a dynamic batch (what build-engine
    --backend torch writes), so the engine compiles it."""
    scripted = torch.jit.load(str(digits_torchscript))
    first, second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)
    with torch.no_grad():
        first.weight.copy_(scripted.state_dict()["1.weight"])
        first.bias.copy_(scripted.state_dict()["1.bias"])
        second.weight.copy_(scripted.state_dict()["3.weight"])
        second.bias.copy_(scripted.state_dict()["3.bias"])
    mlp = torch.nn.Sequential(torch.nn.Flatten(1), first, torch.nn.ReLU(), second).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(mlp, (torch.zeros(2, 1, 8, 8),), dynamic_shapes=({0: batch},))
    path = tmp_path_factory.mktemp("torch") / "digits.pt2"
    torch.export.save(program, str(path))
    return path


def _dynamo_counts(torch: Any) -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items() if k in ("stats", "frames")}


async def test_compiled_program_with_graphs_equals_cpu_stage(
    torch: Any, digits_program: Path, samples: tuple[list[np.ndarray], np.ndarray]
) -> None:
    """torch.compile + one CUDA graph per (slot, bucket), batches padded to buckets
    (17 -> 32, 33 -> 64): the CPU pipeline's answers, and nothing compiled once the
    stage is built (every bucket was warmed before the first batch)."""
    from worker.compute.engines.torch import TorchEngine

    images, _ = samples
    sizes = [1, 64, 17, 64, 33, 3]
    model = dataclasses.replace(
        _torch_model(digits_program),
        preprocess=dataclasses.replace(DIGITS_PP, device="gpu"),
    )
    engine = TorchEngine(digits_program, model, max_batch_size=64)
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, model, 64, 3)
    try:
        for slot in stage.slots:
            assert (
                sorted(slot.context.graphs)
                == [(b, ()) for b in engine.shapes.batches]
                == [(b, ()) for b in (1, 2, 4, 8, 16, 32, 64)]
            )
        before = _dynamo_counts(torch)
        done = await run_stage(stage, source, sink, batches_of(make_jobs(images), sizes))
        assert _dynamo_counts(torch) == before, "something compiled on the hot path"
    finally:
        stage.close()
        engine.close()
    gpu = [a for c in done for a in c.answers]
    cpu = [a for c in await _cpu_results(images, sizes) for a in c.answers]
    assert len(gpu) == len(cpu) == len(images)  # batches_of cycles through sizes
    for c, g in zip(cpu, gpu, strict=True):
        assert g.error is None and g.outputs is not None and c.outputs is not None
        assert g.outputs["topk_indices"][0] == c.outputs["topk_indices"][0]
        np.testing.assert_allclose(
            g.outputs["topk_scores"], c.outputs["topk_scores"], atol=SCORE_ATOL
        )


async def test_a_compiled_stage_evicted_and_loaded_again_answers_the_same(
    torch: Any, digits_program: Path, samples: tuple[list[np.ndarray], np.ndarray]
) -> None:
    """Memory shared by demand on a GPU (issue 68; on the twin:
    tests/unit/compute/test_gpu_evict.py): the stage evicted (its slots, their
    CUDA graphs and the engine freed) and loaded again from a new engine (the
    program compiled and every (slot, bucket) graph captured again) answers as
    before, nothing compiled on the hot path after the load, and the process's
    allocations do not grow over evict/load cycles."""
    import time

    from worker.compute.engines.torch import TorchEngine
    from worker.flow.messages import Batch

    images, _ = samples
    model = dataclasses.replace(
        _torch_model(digits_program),
        preprocess=dataclasses.replace(DIGITS_PP, device="gpu"),
    )
    source, sink = queues()
    stage = gpu_stage(source, sink, TorchEngine(digits_program, model, max_batch_size=64),
                      model, 64, 2)  # fmt: skip

    async def answers() -> list[Any]:
        out = []
        for seq, start in enumerate(range(0, 96, 48)):
            part = make_jobs(images[start : start + 48])
            done = await stage.run_batch(Batch(part, time.monotonic(), "full", seq))
            out += done.answers
        return out

    try:
        want = await answers()
        for cycle in range(2):  # each load compiles again (from the cache) and captures
            stage.evict()
            assert not stage.loaded and stage.slots == ()
            assert stage.load(TorchEngine(digits_program, model, max_batch_size=64)) >= 0
            before = _dynamo_counts(torch)
            got = await answers()
            assert _dynamo_counts(torch) == before, "something compiled after the load"
            for w, g in zip(want, got, strict=True):
                assert g.error is None and g.outputs is not None and w.outputs is not None
                np.testing.assert_array_equal(g.outputs["topk_indices"], w.outputs["topk_indices"])
                np.testing.assert_allclose(g.outputs["topk_scores"], w.outputs["topk_scores"],
                                           atol=1e-6)  # fmt: skip
            torch.cuda.synchronize()
            if cycle == 0:
                allocated = torch.cuda.memory_allocated()
        assert torch.cuda.memory_allocated() <= allocated * 1.05 + (1 << 20), "grew per cycle"
    finally:
        stage.close()


def test_a_model_that_cannot_be_captured_stops_start_up_naming_the_setting(
    torch: Any, tmp_path: Path
) -> None:
    """A host sync inside forward makes capture fail. On torch 2.11 a failed capture
    leaves the allocator unusable for later captures (pytorch#180395), so the worker
    refuses to start (exit 2, naming model.torch.cuda_graphs) instead of limping on.
    Run as a worker process: the failed capture must not damage this test process."""
    import os
    import subprocess
    import sys

    class Syncing(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 10)

        # x unannotated: TorchScript takes it as a Tensor (it parses type comments,
        # and "Any" from this module's globals would make x an Any).
        def forward(self, x):
            y = self.fc(x.flatten(1))
            if bool(y.sum() > 1e30):  # reads a device value: not capturable
                y = y * 0
            return y

    torch.manual_seed(0)
    path = tmp_path / "syncing.pt"
    torch.jit.script(Syncing().eval()).save(str(path))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    env |= {
        "INFER_WORKER_MODEL__BACKEND": "torch",
        "INFER_WORKER_MODEL__PATH": str(path),
        "INFER_WORKER_MODEL__PREPROCESS__DEVICE": "gpu",
        "INFER_WORKER_MODEL__PREPROCESS__SIZE": "[8, 8]",
        "INFER_WORKER_MODEL__PREPROCESS__CHANNELS": "1",
        "INFER_WORKER_BATCHING__MAX_BATCH_SIZE": "8",
        "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "INFER_WORKER_METRICS__PORT": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "run"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "model.torch.cuda_graphs" in proc.stderr
    # The same model without graphs runs: the eager path answers.
    env["INFER_WORKER_MODEL__TORCH__CUDA_GRAPHS"] = "false"
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "run"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert "model.torch.cuda_graphs" not in proc.stderr, proc.stderr[-3000:]
    assert "no Kafka broker answers at" in proc.stderr or "BrokerUnavailable" in proc.stderr, (
        proc.stderr[-3000:]
    )
