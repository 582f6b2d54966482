"""The pieces of issue 66's GPU benchmarks (``benchmarks.gpu_models``,
``benchmarks.gpu_pipeline``) that decide a figure without a broker: the torch
detector is the ONNX detector, answers are held to the CPU path's, the memory
comes from the worker's own log lines, settings become TOML. The benchmarks
themselves run end to end on the GPU twin (their module docstrings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks.gpu_pipeline import agreement, config, toml_value
from benchmarks.gpu_setups import DETECT_SIDE, detector_onnx, memory_report
from worker.contract import Tensor
from worker.ops.processes import WorkerProcess


def _result(rid: str, box: list[float], digit: int, score: float) -> Any:
    """An answer as ``agreement`` reads it: its outputs."""
    return SimpleNamespace(id=rid, outputs={
        "boxes": Tensor.from_numpy(np.array([box], np.float32)),
        "digit": Tensor.from_numpy(np.array([[digit]], np.int64)),
        "score": Tensor.from_numpy(np.array([[score]], np.float32))})  # fmt: skip


def test_answers_agree_only_with_the_same_box_digit_and_score_within_tolerance() -> None:
    cpu = {f"r{i}": _result(f"r{i}", [1, 2, 13, 14], 3, 0.5) for i in range(4)}
    gpu = {"r0": _result("r0", [1, 2, 13, 14], 3, 0.5004),  # within 1e-3
           "r1": _result("r1", [1, 2, 13, 14], 3, 0.52),  # score off
           "r2": _result("r2", [2, 2, 14, 14], 3, 0.5),  # another box
           "r3": _result("r3", [1, 2, 13, 14], 4, 0.5)}  # fmt: skip
    a = agreement(gpu, cpu, 1e-3)
    assert (a["same_box"], a["same_digit"], a["agree"]) == (3, 3, 1)
    assert a["agree_fraction"] == 0.25 and a["first_differing"] == ["r1", "r2", "r3"]


def test_settings_become_toml_and_the_pipeline_names_both_gpu_models(tmp_path: Path) -> None:
    assert toml_value("[8, 8]") == "[8, 8]" and toml_value("gpu") == '"gpu"'
    assert toml_value("builtin:digits") == '"builtin:digits"' and toml_value("64") == "64"
    import tomllib

    parsed = tomllib.loads(config("gpu-twin", tmp_path, "t.requests", 64))
    assert parsed["models"]["detector"]["backend"] == "gpu-twin"
    assert parsed["models"]["digits"]["preprocess"]["device"] == "gpu"
    steps = [s.get("model") or s.get("op") or s["function"] for s in
             parsed["pipelines"]["read"]["steps"]]  # fmt: skip
    assert steps[1:] == ["detector", "tests.pipeline_functions:peak_boxes", "crop_boxes",
                         "digits"]  # fmt: skip


def test_memory_per_model_comes_from_the_workers_log(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    lines = [{"event": "gpu_memory_share", "fraction": 1.0, "budget_mib": 1000.0},
             {"event": "gpu_model_memory", "model": "big", "mib": 600.0, "ring_mib": 64.0},
             {"event": "gpu_model_memory", "model": "small", "mib": 30.0, "ring_mib": 8.0},
             {"event": "gpu_memory", "used_mib": 640.0}]  # fmt: skip
    log.write_text("not json\n" + "\n".join(json.dumps(e) for e in lines) + "\n")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    # Nothing serves metrics on port 1: the log alone answers.
    m = memory_report(WorkerProcess(proc, 1, str(log)))
    assert m["budget_mib"] == 1000.0 and m["used_mib"] == 640.0 and m["within_budget"] is True
    assert m["per_model"] == {"big": {"mib": 600.0, "ring_mib": 64.0},
                              "small": {"mib": 30.0, "ring_mib": 8.0}}  # fmt: skip


def test_the_torch_detector_is_the_onnx_detector(tmp_path: Path) -> None:
    """The GPU run's exported program and the CPU path's ONNX file compute one map."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx")
    import onnxruntime as ort

    from benchmarks.gpu_setups import conv_detector_module
    from worker.compute.engines.torch_module import describe_program
    from worker.ops.build_torch import build_torch_program

    x = np.random.default_rng(1).random((3, 1, DETECT_SIDE, DETECT_SIDE), np.float32)
    session = ort.InferenceSession(str(detector_onnx(tmp_path / "d.onnx")))
    want = session.run(["heat"], {"x": x})[0]
    with torch.no_grad():
        got = conv_detector_module()(torch.from_numpy(x))["heat"].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    path = build_torch_program("benchmarks.gpu_setups:conv_detector_module", tmp_path,
                               max_batch_size=64,
                               input_shape=(1, DETECT_SIDE, DETECT_SIDE))  # fmt: skip
    io, _ = describe_program(torch, torch.export.load(str(path)))
    side = DETECT_SIDE - 11
    assert [(t.name, t.shape) for t in io.inputs] == [("x", (1, DETECT_SIDE, DETECT_SIDE))]
    assert [(t.name, t.shape) for t in io.outputs] == [("heat", (1, side, side))]
