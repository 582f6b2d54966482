"""Engine contracts that hold on any machine, GPU or not.

- the ONNX Runtime engine (the CPU reference) honours the ``Engine`` protocol;
- the GPU engine modules import without their libraries and fail at construction
  with a typed, explanatory error;
- GPU library errors are translated into ``InferenceFailed`` / ``EngineDead``;
- where postprocessing runs (device kernels vs host fallback) follows the config;
- ``build-engine``'s cache key is deterministic and changes with every component,
  and its CLI explains a missing TensorRT with exit code 2;
- the kernel constants are the exact float32 values the NumPy reference uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.models import image_pre
from worker.compute.cpu import CpuStage
from worker.compute.engines import is_gpu_backend, load_engine
from worker.compute.engines.base import EngineUnavailable
from worker.compute.engines.cuda import translate_gpu_error
from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
from worker.compute.gpu import kernels
from worker.compute.gpu.plan import postprocess_plan
from worker.config import GpuConfig, LimitsConfig, ModelConfig, PostprocessConfig
from worker.flow.errors import ConfigError, EngineDead, InferenceFailed
from worker.model.files import bundled_file, resolve_model_path
from worker.model.inputs import Binding, bind_model
from worker.model.io import EngineInfo, ModelIO, TensorDesc
from worker.model.outputs import OutputPlan
from worker.model.preprocess import preprocess
from worker.ops import build_engine

HAS_CUPY = importlib.util.find_spec("cupy") is not None
HAS_TRT = importlib.util.find_spec("tensorrt") is not None
SAMPLES = Path(str(bundled_file("digits_samples.npz")))

F32 = np.dtype(np.float32)


# --- the CPU engine ------------------------------------------------------------------


def test_onnxruntime_engine_honours_the_protocol() -> None:
    cfg = ModelConfig()
    engine = OnnxRuntimeEngine(resolve_model_path(cfg.path), cfg)
    try:
        info = engine.info
        assert isinstance(info, EngineInfo)
        assert (info.backend, info.input_name, info.output_names) == (
            "onnxruntime",
            "image",
            ("logits",),
        )
        assert info.max_batch_size is None  # dynamic batch
        assert len(info.version) == 16
        with np.load(SAMPLES) as npz:
            images = list(npz["images"][:5])
        out = engine.run({"image": preprocess(images, image_pre())})
        assert set(out) == {"logits"}
        assert out["logits"].shape == (5, 10) and out["logits"].dtype == np.float32
        with pytest.raises(InferenceFailed):
            engine.run({"image": np.zeros((2, 3), np.float32)})  # wrong shape: a per-batch failure
    finally:
        engine.close()
    with pytest.raises(EngineDead):
        engine.run({"image": np.zeros((1, 1, 8, 8), np.float32)})


# --- GPU engines without their libraries -----------------------------------------------


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed: the unavailable path cannot run")
def test_tensorrt_engine_without_tensorrt_is_a_clear_config_error(tmp_path: Path) -> None:
    from worker.compute.engines.tensorrt import TensorRTEngine  # imports without tensorrt

    plan = tmp_path / "model.plan"
    plan.write_bytes(b"not a plan")
    with pytest.raises(EngineUnavailable, match="TensorRT") as info:
        TensorRTEngine(plan, ModelConfig(backend="tensorrt", path=str(plan)))
    assert isinstance(info.value, ConfigError)


def test_torch_engine_without_torch_is_a_clear_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.compute.engines.torch import TorchEngine  # imports without torch

    monkeypatch.setitem(sys.modules, "torch", None)  # import fails as if not installed

    model = tmp_path / "model.pt"
    model.write_bytes(b"x")
    with pytest.raises(EngineUnavailable, match="PyTorch"):
        TorchEngine(model, ModelConfig(backend="torch", path=str(model)))


def test_one_factory_picks_the_engine_by_backend() -> None:
    assert is_gpu_backend("torch") and is_gpu_backend("tensorrt")
    assert not is_gpu_backend("onnxruntime")
    engine = load_engine(ModelConfig(backend="onnxruntime"))
    try:
        assert engine.info.backend == "onnxruntime"
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="not available"):
        load_engine(ModelConfig(backend="nonsense"))  # type: ignore[arg-type]


class FakeGpuEngine:
    """Enough of ``GpuEngine`` for the stage's start-up checks (no CUDA)."""

    def __init__(self, outputs: tuple[TensorDesc, ...], max_batch: int = 64) -> None:
        self.input = TensorDesc("image", F32, (1, 8, 8))
        self.outputs = outputs
        self.min_batch_size = 1
        self.max_batch_size = max_batch
        self.device = 0
        io = ModelIO((self.input,), tuple(outputs))
        self.info = EngineInfo("fake", "digits", "0", io, max_batch)

    def create_context(self, slot: Any) -> Any:
        return None

    def enqueue(self, slot: Any, batch_size: int) -> None:
        pass

    def run(self, feeds: Any) -> dict[str, np.ndarray]:
        return {}

    def close(self) -> None:
        pass


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed: the stage would start")
def test_gpu_stage_without_cupy_is_a_clear_config_error() -> None:
    import asyncio

    from worker.compute.gpu.stage import GpuStage

    engine = FakeGpuEngine((TensorDesc("logits", F32, (10,)),))
    with pytest.raises(EngineUnavailable, match="CuPy"):
        GpuStage(asyncio.Queue(), asyncio.Queue(), engine, _binding(engine),
                          max_batch_size=64, num_slots=2, gpu=GpuConfig())  # fmt: skip


def test_gpu_stage_takes_batches_larger_than_the_engine_profile_in_chunks() -> None:
    """A batch larger than the engine's largest (a model of fixed batch, a plan's
    profile) runs in chunks: not a start-up error. Past the size checks, this host
    stops at CuPy."""
    import asyncio

    from worker.compute.gpu.stage import GpuStage

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the stage would start on the fake engine")
    engine = FakeGpuEngine((TensorDesc("logits", F32, (10,)),), max_batch=16)
    with pytest.raises(EngineUnavailable, match="CuPy"):
        GpuStage(asyncio.Queue(), asyncio.Queue(), engine, _binding(engine),
                          max_batch_size=32, num_slots=2, gpu=GpuConfig())  # fmt: skip
    with pytest.raises(ConfigError, match="num_slots"):
        GpuStage(asyncio.Queue(), asyncio.Queue(), engine, _binding(engine),
                          max_batch_size=16, num_slots=0, gpu=GpuConfig())  # fmt: skip


def test_a_stage_cannot_be_built_without_the_workers_binding() -> None:
    """No default binding: a stage built without the one the worker made would run
    under other limits and length buckets (it used to bind its own, silently)."""
    engine = load_engine(ModelConfig())
    with pytest.raises(TypeError, match="binding"):
        CpuStage(None, None, engine, max_batch_size=64, max_inflight=1)  # type: ignore[call-arg, arg-type]
    with pytest.raises(TypeError):
        CpuStage(None, None, engine, ModelConfig(), 64, 1)  # type: ignore[call-arg, arg-type, misc]
    engine.close()


def _binding(engine: Any, model: ModelConfig | None = None) -> Binding:
    return bind_model(model or ModelConfig(), engine.info.io, LimitsConfig())


# --- where postprocessing runs -----------------------------------------------------


def _plan_for(outputs: tuple[TensorDesc, ...], post: PostprocessConfig) -> Any:
    engine = FakeGpuEngine(outputs)
    return postprocess_plan(engine, _outputs(engine, ModelConfig(postprocess=post)))


def _outputs(engine: Any, model: ModelConfig) -> OutputPlan:
    """The output plan of a classifier (postprocessing's defaults on)."""
    return OutputPlan(engine.info.io, model, model.postprocess.resolved(classifier=True))


def test_plan_topk_on_device() -> None:
    plan = _plan_for((TensorDesc("logits", F32, (10,)),), PostprocessConfig(top_k=3))
    assert (plan.topk, plan.host_postprocess) == (3, False)
    assert plan.copy_back == ("topk_indices", "topk_scores")
    raw = _plan_for(
        (TensorDesc("logits", F32, (10,)),), PostprocessConfig(top_k=20, include_raw=True)
    )
    assert raw.topk == 10 and raw.copy_back == ("logits", "topk_indices", "topk_scores")


def test_plan_probabilities_on_device() -> None:
    plan = _plan_for((TensorDesc("logits", F32, (1, 10)),), PostprocessConfig(top_k=0))
    assert plan.gpu_softmax_rows and plan.copy_back == ("probabilities",)


def test_plan_falls_back_to_host_where_kernels_differ_from_the_reference() -> None:
    # softmax over the last axis of a [4, 10] row is not one softmax over 40 values
    seg = _plan_for((TensorDesc("logits", F32, (4, 10)),), PostprocessConfig(top_k=3))
    assert seg.host_postprocess and seg.copy_back == ("logits",)
    f64 = _plan_for((TensorDesc("logits", np.dtype(np.float64), (10,)),), PostprocessConfig())
    assert f64.host_postprocess
    # without softmax, top-k over the flattened row is what the reference does
    flat = _plan_for((TensorDesc("logits", F32, (4, 10)),), PostprocessConfig(softmax=False))
    assert not flat.host_postprocess and flat.topk == 3


def test_plan_names_an_unknown_output() -> None:
    engine = FakeGpuEngine((TensorDesc("logits", F32, (10,)),))
    with pytest.raises(ConfigError, match=r"model\.output"):
        postprocess_plan(engine, _outputs(engine, ModelConfig(output="probs")))


# --- error translation ---------------------------------------------------------------


class FakeCudaError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.status = status


class OutOfMemoryError(Exception):  # named like cupy's and torch's
    pass


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (FakeCudaError(700), EngineDead),  # illegal address: sticky
        (FakeCudaError(719), EngineDead),  # launch failure
        (FakeCudaError(710), EngineDead),  # device-side assert
        (FakeCudaError(2), InferenceFailed),  # cudaErrorMemoryAllocation
        (FakeCudaError(1), InferenceFailed),  # invalid value: this call only
        (OutOfMemoryError("out of memory allocating 1 GiB"), InferenceFailed),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), EngineDead),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), InferenceFailed),
        (RuntimeError("shape mismatch"), InferenceFailed),
        (ValueError("bad binding"), InferenceFailed),
    ],
)
def test_translate_gpu_error(exc: Exception, expected: type[Exception]) -> None:
    out = translate_gpu_error(exc, "engine")
    assert type(out) is expected
    assert "engine" in str(out) and type(exc).__name__ in str(out)


def test_translate_passes_our_own_errors_through() -> None:
    dead = EngineDead("gone")
    assert translate_gpu_error(dead, "x") is dead


def test_tensor_spec_sizes() -> None:
    spec = TensorDesc("x", np.dtype(np.float16), (3, 4, 5))
    assert (spec.row_elements, spec.row_bytes) == (60, 120)


# --- build-engine ------------------------------------------------------------------------

KEY = build_engine.EngineKey(
    onnx_sha256="a" * 64,
    tensorrt_version="10.3.0",
    gpu_name="NVIDIA H100 80GB HBM3",
    precision="fp16",
    min_batch=1,
    opt_batch=32,
    max_batch=64,
)


def test_cache_key_is_deterministic() -> None:
    assert KEY.digest() == dataclasses.replace(KEY).digest()
    assert len(KEY.digest()) == 32
    assert KEY.digest() == build_engine.EngineKey(**dataclasses.asdict(KEY)).digest()


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(build_engine.EngineKey)])
def test_cache_key_changes_with_each_component(field: str) -> None:
    value = getattr(KEY, field)
    other: Any
    if field == "precision":
        other = "int8"
    elif isinstance(value, int):
        other = value + 1
    else:
        other = (value or "") + "x"
    assert dataclasses.replace(KEY, **{field: other}).digest() != KEY.digest()


def test_profile_must_be_ordered() -> None:
    build_engine.check_profile(1, 8, 64)
    for bad in ((0, 1, 1), (2, 1, 4), (1, 8, 4)):
        with pytest.raises(ConfigError):
            build_engine.check_profile(*bad)


def test_file_sha256_is_of_the_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    a.write_bytes(b"model")
    b.write_bytes(b"model")
    assert build_engine.file_sha256(a) == build_engine.file_sha256(b)
    b.write_bytes(b"model2")
    assert build_engine.file_sha256(a) != build_engine.file_sha256(b)


def test_calibration_samples_are_preprocessed_with_the_worker_contract() -> None:
    cfg = image_pre()
    inputs, labels = build_engine.load_samples(SAMPLES, dataclasses.replace(cfg, dtype="float16"))
    with np.load(SAMPLES) as npz:
        want = preprocess(list(npz["images"]), cfg)
        assert labels is not None and np.array_equal(labels, npz["labels"])
    assert inputs.dtype == np.float32 and inputs.shape == (360, 1, 8, 8)
    assert np.array_equal(inputs, want)


def test_samples_need_images_or_inputs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, other=np.zeros(3))
    with pytest.raises(ConfigError, match="images"):
        build_engine.load_samples(bad, image_pre())
    pre = tmp_path / "pre.npz"
    np.savez(pre, inputs=np.ones((4, 1, 8, 8), np.float64))
    inputs, labels = build_engine.load_samples(pre, image_pre())
    assert inputs.dtype == np.float32 and labels is None


def test_compare_outputs() -> None:
    ref = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)
    eng = ref.copy()
    eng[3] = [0.4, 0.6]  # one disagreement
    report = build_engine.compare_outputs(eng, ref, np.array([1, 0, 1, 1]))
    assert report.samples == 4
    assert report.top1_agreement == pytest.approx(0.75)
    assert report.accuracy == pytest.approx(1.0)
    assert report.reference_accuracy == pytest.approx(0.75)
    assert report.max_abs_diff == pytest.approx(0.2)
    with pytest.raises(ValueError):
        build_engine.compare_outputs(eng[:2], ref)


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    build_engine.add_arguments(parser)
    args = parser.parse_args(
        ["model.onnx", "--precision", "int8", "--max-batch", "32", "--calibration", "s.npz"]
    )
    assert (args.model, args.precision, args.max_batch, args.opt_batch) == (
        "model.onnx",
        "int8",
        32,
        None,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["model.onnx", "--precision", "int4"])


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed")
def test_cli_without_tensorrt_explains_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_engine.main(["model.onnx", "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT" in err and "not installed" in err


# --- kernel constants --------------------------------------------------------------------


def test_kernel_sources_are_found() -> None:
    assert (kernels.kernel_dir() / "preprocess.cu").is_file()
    assert "preprocess_batch" in kernels.kernel_source("preprocess.cu")
    with pytest.raises(ValueError):
        kernels.kernel_source("../pyproject.toml")


def test_float_literals_are_the_exact_float32_values() -> None:
    for value in (1 / 255, 0.485, 0.229, 1 / 0.229, -0.5, 0.0, 3.0):
        literal = kernels.float_literal(value)
        assert literal.startswith("(") and literal.endswith("f)")
        assert np.float32(float.fromhex(literal[1:-2])) == np.float32(value)
        assert float.fromhex(literal[1:-2]) == float(np.float32(value))
    with pytest.raises(ConfigError):
        kernels.float_literal(float("inf"))


def test_preprocess_defines_use_the_references_inverse_std() -> None:
    cfg = image_pre(
        size=(224, 200), channels=3, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
        layout="NHWC", dtype="float16",
    )  # fmt: skip
    d = dict(kernels.preprocess_defines(cfg))
    assert (d["OUT_H"], d["OUT_W"], d["CHANNELS"]) == ("224", "200", "3")
    assert (d["LAYOUT_NCHW"], d["OUT_HALF"]) == ("0", "1")
    inv = np.float32(1.0) / np.asarray(cfg.std, np.float32)
    for c in range(3):
        assert float.fromhex(d[f"INV_STD_{c}"][1:-2]) == float(inv[c])
        assert float.fromhex(d[f"MEAN_{c}"][1:-2]) == float(np.float32(cfg.mean[c]))
    assert "MEAN_3" not in d


def test_postprocess_defines() -> None:
    d = dict(kernels.postprocess_defines(10, 20, False, "float16"))
    assert d == {
        "NUM_CLASSES": "10",
        "TOP_K": "10",
        "APPLY_SOFTMAX": "0",
        "IN_HALF": "1",
        "BLOCK_SIZE": "32",
    }
    assert kernels.postprocess_block_size(1000) == 256
    assert kernels.postprocess_block_size(33) == 64
    with pytest.raises(ConfigError):
        kernels.postprocess_defines(10, 3, True, "float64")


class _FakeRuntime:
    def __init__(self, status: int) -> None:
        self.status = status

    def eventQuery(self, ptr: int) -> int:
        return self.status


class _FakeCupy:
    """Only what ``event_completed`` touches: ``cupy.cuda.runtime.eventQuery``."""

    def __init__(self, status: int) -> None:
        self.cuda = type("cuda", (), {"runtime": _FakeRuntime(status)})()


class _FakeEvent:
    ptr = 1234


def test_event_completed_reads_the_status_not_just_done() -> None:
    from worker.compute.engines.cuda import event_completed

    assert event_completed(_FakeCupy(0), _FakeEvent()) is True
    assert event_completed(_FakeCupy(600), _FakeEvent()) is False  # still running
    with pytest.raises(EngineDead, match="700"):
        event_completed(_FakeCupy(700), _FakeEvent())  # illegal address: sticky
    with pytest.raises(InferenceFailed):
        event_completed(_FakeCupy(1), _FakeEvent())
