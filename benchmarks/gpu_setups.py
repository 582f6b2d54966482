"""What ``benchmarks.gpu_models`` and ``benchmarks.gpu_pipeline`` (issue 66, items
3 and 4) serve on each backend, and how they read a run's GPU figures.

Backends: ``torch`` on a GPU (ResNet-50 exported as ``bench --model resnet50``
exports it, the bundled digits MLP as TorchScript, the pipeline's detector as an
exported program with the ONNX detector's own weights), or ``gpu-twin``: the GPU
stage's own code on the CPU with ONNX Runtime as the engine, so the benchmarks'
plumbing runs on any machine. Twin figures are not GPU figures: they prove the
wiring, not the speed. ``onnxruntime`` (the CPU path) is the pipeline's reference.

Memory per model comes from the worker's own log lines (``gpu_memory_share``:
the process's budget; ``gpu_model_memory``: what each model's stage took as it
started; ``gpu_memory``: what the process held after the last), the figures
``DeviceShare`` publishes (docs/guides/models.md). Benchmark code, not shipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from worker.bench.report import cpu_device, device_slug
from worker.ops.processes import WorkerProcess

BACKENDS: Final = ("torch", "gpu-twin")
ROOT: Final = Path(__file__).resolve().parents[1]
# The detector's input side, in pixels: an exported program is fixed in H and W
# (padding a convolution's input would change its map), so every request is this size.
DETECT_SIDE: Final = 48
DETECTOR_SEED: Final = 0  # tests.onnx_models.conv_detector's default weights
# The digits model's preprocessing where its file (TorchScript) declares none: as the
# ONNX file declares it (tests/integration/test_gpu_twin.py's TORCH_PREPROCESS).
DIGITS_TORCH_PREPROCESS: Final = {
    "size": "[8, 8]", "channels": "1", "scale": "0.00392156862745098", "mean": "[0.5]",
    "std": "[0.5]", "layout": "NCHW", "dtype": "float32",
}  # fmt: skip


MEMORY_EVENTS: Final = ("gpu_memory_share", "gpu_model_memory", "gpu_memory")


def device_of(backend: str) -> str:
    """The results' ``device``: the GPU's slug, or the CPU's with ``-gpu-twin`` (so a
    twin run can never be read as a GPU figure)."""
    if backend != "torch":
        return f"{cpu_device()}-{backend}"
    from worker.compute.engines.cuda import gpu_name

    return device_slug(gpu_name(0))


def digits_model(backend: str, work: Path, key: str) -> dict[str, str]:
    """The bundled digits model as ``key`` (``models.NAME``) serves it on ``backend``,
    as dotted settings (TOML literals, as ``--set`` takes them)."""
    if backend != "torch":
        gpu = {f"{key}.preprocess.device": "gpu"} if backend == "gpu-twin" else {}
        return {f"{key}.path": "builtin:digits", f"{key}.backend": backend, **gpu}
    path = work / "digits.pt"
    if not path.is_file():  # the conversion checks itself against ONNX Runtime
        script = ROOT / "scripts" / "digits_torchscript.py"
        subprocess.run([sys.executable, str(script), str(path)], check=True, timeout=300)
    out = {f"{key}.path": str(path), f"{key}.backend": "torch", f"{key}.output": "logits",
           f"{key}.preprocess.device": "gpu"}  # fmt: skip
    out |= {f"{key}.preprocess.{k}": v for k, v in DIGITS_TORCH_PREPROCESS.items()}
    return out


def detector_model(backend: str, work: Path, key: str, max_batch: int) -> dict[str, str]:
    """The pipeline's detector (tests.onnx_models.conv_detector's: one 12x12
    convolution, ``x`` -> ``heat``, its weights) as ``key`` on ``backend``, fixed at
    ``DETECT_SIDE`` x ``DETECT_SIDE``: an ONNX file, or for torch the same weights
    exported as a program (``conv_detector_module``). Fixed, since a GPU stage
    sizes its buffers for every dimension and nothing bounds a free map's."""
    if backend != "torch":
        return {f"{key}.path": str(detector_onnx(work / "detector.onnx")),
                f"{key}.backend": backend}  # fmt: skip
    from worker.ops.build_torch import build_torch_program

    program = build_torch_program(
        "benchmarks.gpu_setups:conv_detector_module", Path("engines"),
        max_batch_size=max_batch, input_shape=(1, DETECT_SIDE, DETECT_SIDE),
    )  # fmt: skip
    return {f"{key}.path": str(program), f"{key}.backend": "torch"}


def detector_weight() -> np.ndarray:
    return np.random.default_rng(DETECTOR_SEED).normal(size=(1, 1, 12, 12)).astype(np.float32)


def detector_onnx(path: Path) -> Path:
    from onnx import TensorProto, helper, numpy_helper, save

    side, out = DETECT_SIDE, DETECT_SIDE - 11
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["heat"])], "conv_detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, side, side])],
        [helper.make_tensor_value_info("heat", TensorProto.FLOAT, ["batch", 1, out, out])],
        [numpy_helper.from_array(detector_weight(), "w")],
    )  # fmt: skip
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def conv_detector_module() -> Any:
    """``build_torch_program``'s factory: the ONNX detector's convolution in torch,
    its output named ``heat`` (an exported program names a dict's outputs by key)."""
    import torch

    weight = detector_weight()

    class Detector(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 1, 12, bias=False)
            with torch.no_grad():
                self.conv.weight.copy_(torch.from_numpy(weight))

        def forward(self, x: Any) -> dict[str, Any]:
            return {"heat": self.conv(x)}

    return Detector().eval()


def toml_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def metric_series(worker: WorkerProcess, name: str) -> dict[str, float]:
    """Every series of metric ``name`` by its ``model`` label, unfolded (``scrape``
    folds the model labels away: one process, one model, in its other readers)."""
    import urllib.request

    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1 :].rpartition("} ")
            model = next((p.split("=", 1)[1].strip('"') for p in labels.split(",")
                          if p.startswith("model=")), "")  # fmt: skip
            out[model] = float(value)
    return out


def memory_report(worker: WorkerProcess) -> dict[str, Any]:
    """The process's GPU budget and what each model took of it, from the worker's
    log (JSON lines, logging level info) and its metrics."""
    events: dict[str, list[dict[str, Any]]] = {}
    with open(worker.log_path, errors="replace") as fh:
        for line in fh:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") in MEMORY_EVENTS:
                events.setdefault(event["event"], []).append(event)
    share = (events.get("gpu_memory_share") or [{}])[-1]
    used = (events.get("gpu_memory") or [{}])[-1]
    models = {e["model"]: {"mib": e.get("mib"), "ring_mib": e.get("ring_mib")}
              for e in events.get("gpu_model_memory", [])}  # fmt: skip
    try:
        metric = metric_series(worker, "infer_gpu_model_memory_bytes")
    except OSError:
        metric = {}
    for model, value in metric.items():
        models.setdefault(model, {})["metric_mib"] = round(value / 2**20, 1)
    budget = share.get("budget_mib")
    held = used.get("used_mib")
    return {
        "budget_mib": budget,
        "fraction": share.get("fraction"),
        "used_mib": held,
        "within_budget": None if budget is None or held is None else held <= budget,
        "per_model": models,
    }


def nvml_for(backend: str) -> tuple[Any, str | None]:
    """An NVML handle on device 0 for the GPU busy fraction, or None and why."""
    if backend != "torch":
        return None, f"{backend}: no device to sample"
    from worker.compute.gpu.monitor import NvmlDevice, NvmlUnavailable, cuda_pci_bus_id

    try:
        return NvmlDevice(0, cuda_pci_bus_id(0)), None
    except NvmlUnavailable as exc:
        return None, str(exc)


def percentiles(values_ms: Iterable[float]) -> dict[str, float]:
    v = np.asarray(list(values_ms), float)
    if not v.size:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    p50, p99 = np.percentile(v, [50, 99])
    return {"p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3),
            "max_ms": round(float(v.max()), 3)}  # fmt: skip


def write_results(summary: Mapping[str, Any], results_dir: Path, stem: str,
                  json_out: str | None) -> Path:  # fmt: skip
    """``<dir>/<date>-<device>-<stem>.json``, never over an earlier run (``-2``...)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    base = f"{summary['date']}-{summary['device']}-{stem}"
    path = results_dir / f"{base}.json"
    n = 2
    while path.exists():
        path = results_dir / f"{base}-{n}.json"
        n += 1
    text = json.dumps(summary, indent=2) + "\n"
    path.write_text(text)
    if json_out:
        Path(json_out).write_text(text)
    return path


def note(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
