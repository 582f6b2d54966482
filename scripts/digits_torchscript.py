"""Rebuild the bundled digits model as TorchScript, for the ``torch`` backend.

The repository ships ``builtin:digits`` as ONNX only, and ONNX Runtime is the CPU
path; the GPU stage runs TensorRT plans or torch programs. The GPU image
(Dockerfile target ``gpu``) runs this at build time so its worker serves the same
model on the GPU path::

    python scripts/digits_torchscript.py /opt/infer-worker/models/digits.pt

It reads the ONNX file's own initializers (Flatten -> Gemm -> Relu -> Gemm, with
ONNX's Gemm defaults; anything else is refused), builds the same MLP with
``torch.nn``, saves it with ``torch.jit.script``, then loads the saved file and
checks it against ONNX Runtime on the bundled held-out samples (same top-1 on
every sample, logits within 1e-4), so a wrong conversion fails the image build.
Runs on the CPU: no GPU is needed to build the image. Needs ``torch`` and
``onnx`` (the latter only to read the weights) besides the installed worker.
The same conversion as the GPU tests' fixture (tests/gpu/test_gpu_torch.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
from worker.config import ModelConfig
from worker.model.files import bundled_file, resolve_model_path
from worker.model.inputs.image import resolve
from worker.model.preprocess import preprocess

OPS = ["Flatten", "Gemm", "Relu", "Gemm"]
GEMM_DEFAULTS = {("axis", 1), ("alpha", 1.0), ("beta", 1.0), ("transA", 0), ("transB", 0)}
LOGITS_ATOL = 1e-4


def mlp_layers(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(weight, bias) of each Gemm in ``torch.nn.Linear``'s layout: weight is
    (out, in), since ONNX Gemm computes ``x @ W + b`` and Linear ``x @ weight.T + bias``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    ops = [n.op_type for n in model.graph.node]
    if ops != OPS:
        raise SystemExit(f"{path}: expected the ops {OPS}, found {ops}")
    for node in model.graph.node:
        for attr in node.attribute:
            value = onnx.helper.get_attribute_value(attr)
            if (attr.name, value) not in GEMM_DEFAULTS:
                raise SystemExit(f"{path}: {node.name}.{attr.name} = {value!r} is not supported")
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    layers = []
    for node in model.graph.node:
        if node.op_type == "Gemm":
            _, weight, bias = node.input
            layers.append((np.ascontiguousarray(init[weight].T), np.asarray(init[bias])))
    return layers


def numpy_forward(layers: Sequence[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """The MLP in NumPy (the reference the torch module must equal)."""
    h = x.reshape(len(x), -1)
    for i, (weight, bias) in enumerate(layers):
        h = h @ weight.T + bias
        if i < len(layers) - 1:
            h = np.maximum(h, 0)
    return h


def build_module(torch: Any, layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> Any:
    modules: list[Any] = [torch.nn.Flatten(1)]
    for i, (weight, bias) in enumerate(layers):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(weight))
            linear.bias.copy_(torch.from_numpy(bias))
        modules.append(linear)
        if i < len(layers) - 1:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules).eval()


def held_out_batch() -> tuple[np.ndarray, np.ndarray]:
    """The bundled held-out samples, preprocessed as the worker does: (x, labels)."""
    with np.load(Path(str(bundled_file("digits_samples.npz")))) as npz:
        images, labels = list(npz["images"]), np.asarray(npz["labels"])
    cfg = ModelConfig()
    engine = OnnxRuntimeEngine(resolve_model_path(cfg.path), cfg)
    pre = resolve(cfg.preprocess, engine.info.io.inputs[0])  # as the worker binds it
    engine.close()
    return preprocess(images, pre), labels


def onnxruntime_logits(x: np.ndarray) -> np.ndarray:
    cfg = ModelConfig()
    engine = OnnxRuntimeEngine(resolve_model_path(cfg.path), cfg)
    try:
        return engine.run({"image": x})["logits"]
    finally:
        engine.close()


def check_against_onnxruntime(candidate: np.ndarray, reference: np.ndarray) -> None:
    if candidate.shape != reference.shape:
        raise SystemExit(f"logits shape {candidate.shape}, ONNX Runtime {reference.shape}")
    top1 = candidate.argmax(axis=1) == reference.argmax(axis=1)
    if not top1.all():
        raise SystemExit(f"top-1 differs from ONNX Runtime on {int((~top1).sum())} samples")
    worst = float(np.abs(candidate - reference).max())
    if worst > LOGITS_ATOL:
        raise SystemExit(f"logits differ from ONNX Runtime by {worst:.2e} (> {LOGITS_ATOL})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out", type=Path, help="where to write the TorchScript file")
    args = parser.parse_args(argv)
    import torch

    layers = mlp_layers(resolve_model_path(ModelConfig().path))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(build_module(torch, layers)).save(str(args.out))

    x, labels = held_out_batch()
    loaded = torch.jit.load(str(args.out), map_location="cpu").eval()
    with torch.inference_mode():
        logits = loaded(torch.from_numpy(x)).numpy()
    check_against_onnxruntime(logits, onnxruntime_logits(x))
    accuracy = float((logits.argmax(axis=1) == labels).mean())
    print(
        f"{args.out}: TorchScript digits MLP, equal to ONNX Runtime on {len(x)} held-out "
        f"samples (accuracy {accuracy:.2%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
