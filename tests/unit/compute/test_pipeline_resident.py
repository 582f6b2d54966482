"""A pipeline's GPU steps hand each other device arrays (``worker.compute.resident``),
here on the GPU stage's CPU twin (``gpu-twin``, whose ``is_device`` tells its
device arrays from host ones): crop_boxes' crops go into the classifier's slot
device to device, a model's output into the next model's, and only what the
answer (or a host step) reads is downloaded; every answer equals the host
path's (the models on the CPU stage, the ops as NumPy operations)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu.support import gpu_stage, queues
from tests.models import cpu_stage
from tests.onnx_models import _save
from tests.unit.compute.test_pipeline_device_ops import _pixels
from worker.app.pipelines import StepModel, build_plan
from worker.compute import resident
from worker.compute.engines import load_engine
from worker.compute.gpu.ops import TRANSFERS
from worker.compute.gpu.twin import cupy_for
from worker.compute.ops.device import DeviceOps
from worker.compute.pipeline import PipelineStage
from worker.compute.stage import Stage
from worker.config import GpuConfig, ModelConfig, PipelineConfig, StepConfig
from worker.config.model import PostprocessConfig, PreprocessConfig
from worker.flow.messages import Batch, Completed, Job

pytest.importorskip("onnx")

POST = PostprocessConfig(top_k=3, include_raw=True)
DIGITS_GPU = ModelConfig(path="builtin:digits", backend="gpu-twin",
                         preprocess=PreprocessConfig(device="gpu"), postprocess=POST)  # fmt: skip
DIGITS_CPU = ModelConfig(path="builtin:digits", postprocess=POST)
STEPS = (
    StepConfig(name="find", function="tests.pipeline_functions:scattered_boxes",
               inputs={"pixels": "request.pixels"},
               outputs={"boxes": "float32 [n, 4]", "scores": "float32 [n]"}),
    StepConfig(name="keep", op="nms", iou_threshold=0.3,
               inputs={"boxes": "find.boxes", "scores": "find.scores"}),
    StepConfig(name="crop", op="crop_boxes", size=(8, 8),
               inputs={"image": "request.pixels", "boxes": "keep.boxes"}),
    StepConfig(name="digit", model="digits", inputs={"image": "crop.crops"}),
    StepConfig(name="mix", model="mix", inputs={"x": "digit.logits"}),
)  # fmt: skip
OUTPUTS = {"kept": "keep.indices", "digit": "digit.topk_indices", "score": "digit.topk_scores",
           "mixed": "mix.y"}  # fmt: skip


def _mix(path: Path) -> Path:
    """``x`` float32 [batch, 10] -> ``y`` float32 [batch, 3]: a seeded linear layer,
    reading the classifier's logits."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(5).normal(size=(10, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mix",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    return _save(graph, path)


def _gpu(model: ModelConfig, gpu: GpuConfig) -> Stage:
    engine = load_engine(model, max_batch_size=16)
    source, sink = queues()
    stage: Stage = gpu_stage(source, sink, engine, model, 16, 2, gpu, cupy=cupy_for("gpu-twin"))
    return stage


async def _serve(tmp_path: Path, jobs: list[Job], on_gpu: bool,
                 steps: tuple[StepConfig, ...] = STEPS,
                 outputs: Mapping[str, str] = OUTPUTS) -> Completed:  # fmt: skip
    mix = str(_mix(tmp_path / "mix.onnx"))
    gpu = GpuConfig(max_input_bytes=1 << 12)  # 64 crops of 8x8 a run: several runs a step
    if on_gpu:
        models = {"digits": _gpu(DIGITS_GPU, gpu),
                  "mix": _gpu(ModelConfig(path=mix, backend="gpu-twin"), gpu)}  # fmt: skip
        device: DeviceOps | None = DeviceOps.on("gpu-twin", 0)
    else:
        models = {"digits": cpu_stage(DIGITS_CPU), "mix": cpu_stage(ModelConfig(path=mix))}
        device = None
    pipeline = PipelineConfig(topics=("in",), inputs={"pixels": "uint8 [H, W, 1]"},
                              steps=steps, outputs=dict(outputs))  # fmt: skip
    plan = build_plan("p", pipeline, {name: StepModel(s.info, s.binding, s)
                                      for name, s in models.items()}, device)  # fmt: skip
    served = PipelineStage(asyncio.Queue(), asyncio.Queue(), models["digits"].info,
                           models["digits"].binding, plan, max_inflight=2)  # fmt: skip
    try:
        return await served.run_batch(Batch(jobs, time.monotonic(), "full"))
    finally:
        served.close()


def _same(got: Completed, want: Completed) -> None:
    for g, w in zip(got.answers, want.answers, strict=True):
        assert (g.error is None) == (w.error is None), (g.error, w.error)
        if w.error is not None:
            assert g.error is not None and g.error.message == w.error.message
            continue
        assert g.outputs is not None and w.outputs is not None
        assert g.outputs.keys() == w.outputs.keys()
        for name, want_value in w.outputs.items():
            assert type(g.outputs[name]) is np.ndarray
            assert not cupy_for("gpu-twin").is_device(g.outputs[name]), name  # on the host
            if want_value.dtype.kind == "f":
                np.testing.assert_allclose(g.outputs[name], want_value, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(g.outputs[name], want_value, err_msg=name)


async def test_gpu_steps_keep_their_intermediates_on_the_device(tmp_path: Path) -> None:
    jobs = _pixels(24, outside=False)
    resident.DOWNLOADED.clear()
    TRANSFERS.reset()
    got = await _serve(tmp_path, jobs, on_gpu=True)
    downloaded = dict(resident.DOWNLOADED)
    copies = TRANSFERS.device_copies
    want = await _serve(tmp_path, jobs, on_gpu=False)
    _same(got, want)
    assert got.engine_rows == want.engine_rows  # every crop through both models
    # The crops went into the classifier's slots, its logits into the mixer's,
    # device to device (each in several runs of a slot); only what the answer
    # reads came back, once each.
    assert "crop.crops" not in downloaded and "digit.logits" not in downloaded
    assert downloaded == {"digit.topk_indices": 1, "digit.topk_scores": 1, "mix.y": 1}
    assert copies >= 4


async def test_a_host_step_after_a_gpu_step_reads_host_arrays(tmp_path: Path) -> None:
    """A function reading the crops gets them on the host (one download, for the
    batch), and the answer is the host path's."""
    seen: list[bool] = []
    steps = (*STEPS[:4], StepConfig(name="look", function=f"{__name__}:looked",
                                    inputs={"crops": "crop.crops"},
                                    outputs={"bright": "uint8 []"}))  # fmt: skip
    outputs = {"digit": "digit.topk_indices", "bright": "look.bright"}
    jobs = _pixels(12, outside=False)
    resident.DOWNLOADED.clear()
    SEEN.clear()
    got = await _serve(tmp_path, jobs, True, steps, outputs)
    seen = list(SEEN)
    assert resident.DOWNLOADED["crop.crops"] == 1
    want = await _serve(tmp_path, jobs, False, steps, outputs)
    _same(got, want)
    assert seen and not any(seen)  # never a device array


async def test_rows_the_device_refuses_run_as_the_host_runs_them(tmp_path: Path) -> None:
    """A box with no pixel: crop_boxes' batch runs as the NumPy operation, which
    names the request; the others are answered as on the host."""
    jobs = _pixels(12, outside=True)
    got = await _serve(tmp_path, jobs, on_gpu=True)
    want = await _serve(tmp_path, jobs, on_gpu=False)
    assert any(a.error is not None for a in want.answers)
    _same(got, want)


SEEN: list[bool] = []  # per call of ``looked``: whether it was given a device array


def looked(crops: Any) -> dict[str, np.ndarray]:
    SEEN.append(bool(cupy_for("gpu-twin").is_device(crops)))
    return {"bright": np.asarray(crops.max(), np.uint8)}
