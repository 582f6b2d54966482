"""GPU tests: marked ``gpu`` and skipped, with the reason, where CUDA is absent.

The skip logic lives here once. Test modules in this directory import CuPy, torch
and TensorRT only inside tests and fixtures, never at module level, so they are
collected (and reported as skipped with a reason) on any machine. Tests that
also need torch with CUDA carry ``@pytest.mark.needs_torch``; tests that need
TensorRT carry ``@pytest.mark.needs_tensorrt``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.model.files import resolve_model_path

HERE = Path(__file__).resolve().parent
GEMM_DEFAULTS = {("axis", 1), ("alpha", 1.0), ("beta", 1.0), ("transA", 0), ("transB", 0)}


@cache
def cuda_unavailable() -> str | None:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy wheel for another CUDA
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver
        return f"CUDA is not usable ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device is visible"


@cache
def torch_unavailable() -> str | None:
    try:
        import torch
    except Exception as exc:
        return f"torch is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA"
    return None


@cache
def tensorrt_unavailable() -> str | None:
    try:
        import tensorrt
    except Exception as exc:
        return f"tensorrt is not importable ({type(exc).__name__}: {exc})"
    if int(str(tensorrt.__version__).split(".")[0]) < 10:
        return f"tensorrt {tensorrt.__version__} is older than 10"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_torch: GPU test that also needs torch with CUDA")
    config.addinivalue_line("markers", "needs_tensorrt: GPU test that also needs TensorRT 10+")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        reason = cuda_unavailable()
        if reason is None and item.get_closest_marker("needs_torch"):
            reason = torch_unavailable()
        if reason is None and item.get_closest_marker("needs_tensorrt"):
            reason = tensorrt_unavailable()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


@pytest.fixture(scope="session")
def torch() -> Any:
    """torch with TF32 off, so a GPU GEMM really is float32 (only requested by
    tests that were not skipped)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


@pytest.fixture
def cp() -> Any:
    """The CuPy module (only requested by tests that were not skipped)."""
    import cupy

    return cupy


@pytest.fixture(scope="session")
def digits_torchscript(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits.onnx as a TorchScript file, weights read with onnx.numpy_helper."""
    onnx = pytest.importorskip("onnx", reason="onnx is needed to read the bundled weights")
    from onnx import numpy_helper

    model = onnx.load(str(resolve_model_path("builtin:digits")))
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Flatten", "Gemm", "Relu", "Gemm"], ops
    for node in model.graph.node:  # the MLP below assumes ONNX Gemm defaults
        for attr in node.attribute:
            value = onnx.helper.get_attribute_value(attr)
            assert (attr.name, value) in GEMM_DEFAULTS, (node.name, attr.name, value)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    # ONNX Gemm computes x @ W + b; torch.nn.Linear computes x @ weight.T + bias.
    first, second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)
    with torch.no_grad():
        for layer, (weight, bias) in ((first, ("W1", "b1")), (second, ("W2", "b2"))):
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w[weight].T)))
            layer.bias.copy_(torch.from_numpy(w[bias]))
    mlp = torch.nn.Sequential(torch.nn.Flatten(1), first, torch.nn.ReLU(), second).eval()
    path = tmp_path_factory.mktemp("torch") / "digits.pt"
    torch.jit.script(mlp).save(str(path))
    return path
