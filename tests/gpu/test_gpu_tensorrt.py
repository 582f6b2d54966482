"""TensorRT: build-engine on the bundled ONNX model, the engine, and the GPU stage with it.

Needs ``tensorrt`` >= 10 with its builder (see DESIGN.md: not obtainable from the
package registries; skipped with the reason where absent). Tolerances: FP32 plan
logits within ``atol = 1e-4`` of ONNX Runtime; an FP16 plan must agree on top-1
for at least 99% of the held-out samples (reduced precision may flip a near-tie).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import gpu_stage
from tests.models import cpu_stage
from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
from worker.config import ModelConfig, PreprocessConfig
from worker.model.files import bundled_file, resolve_model_path
from worker.model.inputs.image import resolve_declared
from worker.model.preprocess import preprocess
from worker.ops import build_engine

from .support import batches_of, make_jobs, queues, run_stage

pytestmark = [pytest.mark.gpu, pytest.mark.needs_tensorrt]

ONNX = resolve_model_path("builtin:digits")
SAMPLES = Path(str(bundled_file("digits_samples.npz")))


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("plans")
    return {
        precision: build_engine.build_engine(
            ONNX, out, precision=precision, min_batch=1, opt_batch=32, max_batch=64,
            timing_cache=out / "timing.cache", workspace_mb=256,
        )
        for precision in ("fp32", "fp16")
    }  # fmt: skip


def _model(plan: Path) -> ModelConfig:
    # GPU preprocessing, as the stage's old default was.
    preprocess = PreprocessConfig(device="gpu")
    return ModelConfig(
        name="digits", path=str(plan), backend="tensorrt", output="logits", preprocess=preprocess
    )


def test_plan_cache_is_reused(plans: dict[str, Path]) -> None:
    plan = plans["fp32"]
    before = plan.stat().st_mtime_ns
    again = build_engine.build_engine(
        ONNX, plan.parent, precision="fp32", min_batch=1, opt_batch=32, max_batch=64
    )
    assert again == plan and plan.stat().st_mtime_ns == before
    assert (plan.parent / "timing.cache").is_file()
    assert plans["fp16"] != plan
    assert (plan.parent / f"{plan.stem}.json").is_file()


def test_engine_shapes_and_parity_with_onnxruntime(plans: dict[str, Path]) -> None:
    from worker.compute.engines.tensorrt import TensorRTEngine

    engine = TensorRTEngine(plans["fp32"], _model(plans["fp32"]))
    cfg = ModelConfig()
    cpu = OnnxRuntimeEngine(ONNX, cfg)
    try:
        assert (engine.min_batch_size, engine.max_batch_size) == (1, 64)
        assert engine.inputs[0].name == "image" and engine.inputs[0].shape == (1, 8, 8)
        assert [(o.name, o.shape) for o in engine.outputs] == [("logits", (10,))]
        with np.load(SAMPLES) as npz:
            # The digits file's 8x8 grey input, resolved as the stage resolves it.
            pp = resolve_declared(PreprocessConfig(size=(8, 8), channels=1), "the digits model")
            x = preprocess(list(npz["images"][:64]), pp)
        for n in (1, 7, 64):
            np.testing.assert_allclose(
                engine.run({"image": x[:n]})["logits"],
                cpu.run({"image": x[:n]})["logits"],
                atol=1e-4,
            )
    finally:
        engine.close()
        cpu.close()


def test_fp16_accuracy_against_fp32_reference(plans: dict[str, Path]) -> None:
    report = build_engine.evaluate_accuracy(plans["fp16"], SAMPLES, onnx_path=ONNX)
    assert report.samples == 360
    assert report.top1_agreement >= 0.99, report
    assert report.accuracy is not None and report.accuracy >= 0.96


@pytest.mark.parametrize("cuda_graphs", [False, True])
async def test_gpu_stage_with_tensorrt_equals_cpu_stage(
    plans: dict[str, Path], cuda_graphs: bool
) -> None:
    from worker.compute.engines.tensorrt import TensorRTEngine

    with np.load(SAMPLES) as npz:
        images = list(npz["images"])
    # Padded to the buckets 8, 32, 64. Full batches replay the graph, are run
    # normally after a smaller one (and captured again), then replay it.
    sizes = [64, 64, 1, 17, 64, 64, 64, 1, 17, 17]
    cfg = ModelConfig()
    cpu_engine = OnnxRuntimeEngine(ONNX, cfg)
    source, sink = queues()
    reference = cpu_stage(cfg, cpu_engine, batches_in=source, completed_out=sink, max_inflight=2)
    try:
        cpu = await run_stage(reference, source, sink, batches_of(make_jobs(images), sizes))
    finally:
        reference.close()
        cpu_engine.close()
    plan = plans["fp32"]
    engine = TensorRTEngine(plan, _model(plan), cuda_graphs=cuda_graphs, buckets=(8, 32, 64))
    source, sink = queues()
    stage = gpu_stage(source, sink, engine, _model(plan), 64, 2)
    try:
        for slot in stage.slots:  # every bucket warmed at start-up, the largest's graph captured
            assert slot.context.buckets == (8, 32, 64) and slot.context.batch == 64
            assert (slot.context.graph is not None) == cuda_graphs
        gpu = await run_stage(stage, source, sink, batches_of(make_jobs(images), sizes))
    finally:
        stage.close()
        engine.close()
    got: list[Any] = [a.outputs for c in gpu for a in c.answers]
    want: list[Any] = [a.outputs for c in cpu for a in c.answers]
    for g, w in zip(got, want, strict=True):
        assert g["topk_indices"][0] == w["topk_indices"][0]
        np.testing.assert_allclose(g["topk_scores"], w["topk_scores"], atol=1e-5)


def test_more_slots_than_profiles_is_a_config_error(tmp_path: Path) -> None:
    from worker.compute.engines.tensorrt import TensorRTEngine
    from worker.flow.errors import ConfigError

    plan = build_engine.build_engine(
        ONNX, tmp_path, precision="fp32", min_batch=1, opt_batch=8, max_batch=8, profiles=1
    )
    engine = TensorRTEngine(plan, _model(plan))
    source, sink = queues()
    try:
        assert engine.num_profiles == 1
        with pytest.raises(ConfigError, match="--profiles 2"):
            gpu_stage(source, sink, engine, _model(plan), 8, 2)
    finally:
        engine.close()


def test_cli_builds_and_evaluates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(ONNX), "--out-dir", str(tmp_path), "--precision", "fp16", "--max-batch", "32",
            "--profiles", "2", "--evaluate", str(SAMPLES)]  # fmt: skip
    assert build_engine.main(args) == 0
    out = capsys.readouterr().out
    assert '"top1_agreement"' in out
    plan = Path(next(line for line in out.splitlines() if line.startswith(str(tmp_path))))
    assert plan.is_file() and plan.parent == tmp_path
