"""``bench --model`` on a GPU: the engine-alone branch for a ``GpuEngine`` (one
slot made as the GPU stage makes it, the largest batch enqueued on its stream),
and the whole ResNet-50 run of the README, small, where torchvision and
scikit-image are installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worker.bench.engine import engine_rate
from worker.bench.payloads import payload_inputs, requests
from worker.config import load_settings
from worker.ops.processes import extended_pythonpath, override_env

pytestmark = [pytest.mark.gpu, pytest.mark.needs_torch]

ROOT = Path(__file__).resolve().parents[2]
E2E_TIMEOUT_S = 200


@pytest.fixture(scope="module")
def tiny_torchscript(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits-shaped linear model (random weights) as TorchScript."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(64, 10)).eval()
    path = tmp_path_factory.mktemp("modelbench") / "tiny.pt"
    torch.jit.script(model).save(str(path))
    return path


@pytest.mark.parametrize("cuda_graphs", ["true", "false"])
def test_gpu_engine_alone_on_one_slot(tiny_torchscript: Path, cuda_graphs: str) -> None:
    settings = load_settings(
        env=override_env(
            {
                "model.backend": "torch",
                "model.path": str(tiny_torchscript),
                "model.preprocess.device": "gpu",
                # A TorchScript file does not declare its input: the digits' 8x8 grey.
                "model.preprocess.size": "[8, 8]",
                "model.preprocess.channels": "1",
                "model.torch.cuda_graphs": cuda_graphs,
                "batching.max_batch_size": "16",
            }
        )
    )
    rate = engine_rate(settings, requests(*payload_inputs("digits", "raw"), "e", 3), seconds=0.2)
    assert 0 < rate < float("inf")


def _missing(*modules: str) -> str | None:
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(absent)}" if absent else None


@pytest.mark.skipif(
    _missing("torchvision", "skimage") is not None,
    reason=str(_missing("torchvision", "skimage")),
)
def test_resnet50_jpeg_bench_end_to_end(tmp_path: Path) -> None:
    """The README's GPU command with a small backlog and two processes. It
    checks the pipeline, not speed: the model runs uncompiled (CUDA graphs
    still) at batches up to 16, so start-up takes seconds rather than
    compiling ResNet-50 in three processes (compilation is covered by
    test_gpu_torch.py)."""
    results = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable, "-m", "worker", "bench", "--model", "resnet50", "--payload", "jpeg",
            "--procs", "2", "--partitions", "4", "--records", "4000", "--duration", "2",
            "--results-dir", str(results),
            "--set", "model.torch.compile=off", "--set", "batching.max_batch_size=16",
        ],
        capture_output=True,
        check=False,
        text=True,
        # Under a timeout of its own, so the test
        # fails with the bench's output rather than being stopped without it.
        timeout=E2E_TIMEOUT_S,
        cwd=tmp_path,  # engines/ (the exported program) goes here, not into the checkout
        # Extended, never replaced: the GPU machine's packages are on PYTHONPATH.
        env={**os.environ, "PYTHONPATH": extended_pythonpath(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = results.iterdir()
    s: dict[str, Any] = json.loads(path.read_text())
    assert not s["device"].startswith("cpu") and s["settings"]["model"]["backend"] == "torch"
    assert s["engine_img_s"] > s["worker_img_s"] > 0 and s["ingest_ceiling_rec_s"] > 0
    assert 1 <= s["mean_batch"] <= 16
    if importlib.util.find_spec("pynvml") is not None:
        assert s["gpu_busy"] is not None and 0 <= s["gpu_busy"] <= 1
    paced = s["paced"]
    assert paced["answered"] == paced["sent"] and paced["p99_ms"] > 0
    assert {"queue", "preprocess", "infer", "d2h", "total"} <= set(paced["stages"])
