"""Start-up of the torch engine on CPU torch: cold and warm compile cache, against
compiling each batch bucket on its own (what the engine did before issue 22).

    python -m benchmarks.torch_start --model resnet18 --max-batch 16

One child process per measurement, so nothing compiled stays in memory between
them; all children share one ``TORCHINDUCTOR_CACHE_DIR`` made for this run:

- ``static``: the exported program compiled with ``dynamic=False`` and every
  bucket run once (one compilation per bucket), on an empty cache (the baseline);
- ``cold``: the engine as the worker builds it (one compilation, dynamic in the
  batch, every bucket warmed), on an empty cache;
- ``warm``: the same again, the cache now filled by ``cold``, as a second member
  of ``run --procs N`` or a restart finds it.

Each child reports its load, warm-up and per-bucket milliseconds (the engine's
``torch_slot_warmed`` log) and how many graphs dynamo compiled, as one JSON
line; the summary goes to ``--json``.
CPU figures say how the parts compare, not what a GPU takes (nothing here
compiles for CUDA or captures graphs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from worker.ops.children import children_die_with_this_process
from worker.ops.processes import extended_pythonpath

ROOT = Path(__file__).resolve().parent.parent


def _export(model: str, max_batch: int, out_dir: Path) -> Path:
    """The torchvision model (random weights) as a .pt2, through build-engine."""
    cmd = [sys.executable, "-m", "worker", "build-engine", "--backend", "torch",
           f"torchvision:{model}", "--input-shape", "3,224,224", "--max-batch",
           str(max_batch), "--out-dir", str(out_dir)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    (path,) = out_dir.glob("*.pt2")
    return path


CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
mode, path, max_batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
started = time.monotonic()
import torch
from worker.model.shapes import bucket_sizes
buckets = bucket_sizes(max_batch)
if mode == "static":
    program = torch.export.load(path).module()
    t0 = time.monotonic()
    compiled = torch.compile(program, dynamic=False)
    shape_ms = {}
    with torch.inference_mode():
        for b in reversed(buckets):
            t = time.monotonic()
            for _ in range(3):
                compiled(torch.zeros(b, 3, 224, 224))
            shape_ms[str(b)] = round((time.monotonic() - t) * 1e3, 1)
    out = {"load_s": round(t0 - started, 2), "warm_s": round(time.monotonic() - t0, 2),
           "shape_ms": shape_ms}
else:
    import structlog
    from worker.config import ModelConfig, TorchConfig
    from worker.model.shapes import SlotShapes
    from worker.compute.engines.torch import TorchEngine
    events = []
    structlog.configure(processors=[lambda _l, _m, e: events.append(e) or ""],
                        logger_factory=structlog.ReturnLoggerFactory())
    cfg = ModelConfig(path=path, backend="torch", torch=TorchConfig(
        precision="float32", channels_last=True, cuda_graphs=False))
    engine = TorchEngine(Path(path), cfg, device="cpu", max_batch_size=max_batch)
    engine.prepare(SlotShapes(tuple(buckets)))
    t0 = time.monotonic()
    class Slot: pass
    slot = Slot()
    slot.index, slot.device, slot.stream, slot.extra = 0, 0, None, {}
    slot.engine_inputs = {s.name: np.zeros((max_batch, *s.shape), s.dtype) for s in engine.inputs}
    slot.engine_outputs = {s.name: np.zeros((max_batch, *s.shape), s.dtype) for s in engine.outputs}
    slot.context = engine.create_context(slot)
    warmed = [e for e in events if e.get("event") == "torch_slot_warmed"]
    out = {"load_s": round(t0 - started, 2), "warm_s": round(time.monotonic() - t0, 2),
           "shape_ms": warmed[0]["shape_ms"] if warmed else {}}
out["compilations"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
print(json.dumps(out))
"""


def _child(mode: str, path: Path, max_batch: int, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "PYTHONPATH": extended_pythonpath(ROOT)}  # fmt: skip
    started = time.monotonic()
    cmd = [sys.executable, "-c", CHILD, mode, str(path), str(max_batch)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.monotonic() - started, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="a torchvision model name")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = parser.parse_args(argv)
    import torch

    stopping = children_die_with_this_process("benchmarks.torch_start")
    with stopping, tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        path = _export(args.model, args.max_batch, base / "export")
        runs: dict[str, dict[str, Any]] = {}
        for mode, cache in (("static", "cache-static"), ("cold", "cache"), ("warm", "cache")):
            runs[mode] = _child(mode, path, args.max_batch, base / cache)
            print(f"{mode:7s} {json.dumps(runs[mode])}", flush=True)
    summary = {
        "model": args.model, "max_batch": args.max_batch, "torch": torch.__version__,
        "cpus": os.cpu_count(), "runs": runs,
        "cold_vs_static_warm_s": round(runs["cold"]["warm_s"] / runs["static"]["warm_s"], 3),
        "warm_vs_cold_warm_s": round(runs["warm"]["warm_s"] / runs["cold"]["warm_s"], 3),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
