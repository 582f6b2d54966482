"""``bench --model``'s outputs: the device's name, the table on stdout, and the
summary as ``<results-dir>/<date>-<device>-<payload>.json``, never overwriting
(a second run that day gets ``-2``, and so on), with the command line that
reruns it and the settings it ran with.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from worker.app.plan import RunPlan
from worker.bench.options import ModelBenchOptions, unit
from worker.config import Settings
from worker.ops.files import atomic_write

_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}


def device_slug(gpu_name: str) -> str:
    """A GPU's marketing name as a short file-name part: 'NVIDIA H100 80GB HBM3'
    -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX 4090' ->
    'rtx4090'."""
    words = [w for w in re.split(r"[\s\-_]+", gpu_name.lower()) if w]
    words = [w for w in words if w not in _VENDOR_WORDS]
    if not words:
        return "gpu"
    slug = words[0]
    if slug.isalpha() and len(words) > 1:  # "rtx 4090", "rtx a6000"
        slug += words[1]
    return re.sub(r"[^a-z0-9]", "", slug) or "gpu"


def cpu_device() -> str:
    return f"cpu{os.cpu_count() or 1}"


def run_device(settings: Settings) -> str:
    """What the model runs on: the GPU's slug for a GPU backend, else cpu<cores>."""
    if RunPlan.of(settings).device == "cpu":
        return cpu_device()
    try:
        from worker.compute.engines.cuda import gpu_name

        return device_slug(gpu_name(settings.gpu.device))
    except Exception:  # boundary: no CuPy or no device; the engine run says why
        return "gpu"


def results_path(
    results_dir: Path, day: dt.date, device: str, payload: str, procs: int = 1
) -> Path:
    """``<dir>/<date>-<device>-<payload>.json`` (``-procsN`` added for N > 1
    processes), or ``...-2.json`` (and so on) when that exists: a rerun never
    overwrites a recorded result."""
    stem = f"{day.isoformat()}-{device}-{payload}" + (f"-procs{procs}" if procs > 1 else "")
    path = results_dir / f"{stem}.json"
    n = 2
    while path.exists():
        path = results_dir / f"{stem}-{n}.json"
        n += 1
    return path


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def settings_record(settings: Settings, overrides: Mapping[str, str]) -> dict[str, Any]:
    s = settings
    return {
        "overrides": dict(overrides),
        "model": {"name": s.model.name, "path": s.model.path, "backend": s.model.backend,
                  "preprocess": asdict(s.model.preprocess), "torch": asdict(s.model.torch)},
        "batching": asdict(s.batching),
        "gpu": asdict(s.gpu) if RunPlan.of(s).device == "gpu" else None,
    }  # fmt: skip


def command_line(opts: ModelBenchOptions, records: int) -> str:
    """The command that reruns this benchmark, every value spelled out."""
    argv = [
        "infer-worker", "bench", "--model", opts.model, "--payload", opts.payload,
        "--procs", str(opts.procs), "--senders", str(opts.senders or opts.procs),
        "--records", str(records),
        "--partitions", str(opts.partitions), "--duration", f"{opts.duration:g}",
    ]  # fmt: skip
    if opts.rate:
        argv += ["--rate", f"{opts.rate:g}"]
    for key, value in opts.overrides.items():
        argv += ["--set", f"{key}={value}"]
    return shlex.join(argv)


def library_versions(settings: Settings) -> dict[str, str]:
    names = ["onnxruntime"] if settings.model.backend == "onnxruntime" else ["torch", "cupy"]
    out = {}
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "?"))
    return out


def note(text: str) -> None:
    """Progress, to stderr: stdout carries the table alone."""
    print(f"  {text}", file=sys.stderr, flush=True)


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(summary: Mapping[str, Any]) -> str:
    s, p = summary, summary["paced"]
    busy = s["gpu_busy"]
    per_s = unit(s["model"])
    busy_text = "n/a" if busy is None else f"{busy:.0%}"
    if busy is None and s["gpu_busy_note"]:
        busy_text += f"  ({s['gpu_busy_note']})"
    rows = [
        (f"engine alone, batch {s['engine_batch']}", f"{s['engine_img_s']:,.0f} {per_s}"),
        (f"bare consumer drain (ceiling, {s.get('ingest_ceiling_readers', 1)} reader(s))",
         f"{s['ingest_ceiling_rec_s']:,.0f} rec/s"),
        (
            f"worker drain, run --procs {s['procs']}",
            f"{s['worker_img_s']:,.0f} {per_s}  ({_fmt(s['worker_to_ceiling'], '.3g')}x the "
            f"ceiling, {_fmt(s['worker_to_engine'], '.3g')}x the engine)",
        ),
        (
            "  steady state of the drain",
            f"{s['worker_steady_s']:.1f} s of {s['worker_drain_s']:.1f} s, "
            f"{s['records']:,} records",
        ),
        ("mean batch in the drain", f"{s['mean_batch']:.1f}"),
        ("GPU busy in the drain", busy_text),
        (
            f"paced, Poisson at {p['rate']:,.0f}/s",
            f"{p['throughput']:,.0f}/s answered" + ("" if p["sustained"] else "  (NOT sustained)"),
        ),
        (
            "  end to end",
            f"p50 {p['p50_ms']:.1f} ms  p95 {p['p95_ms']:.1f} ms  p99 {p['p99_ms']:.1f} ms",
        ),
    ]
    lines = [f"  {label:<32} {value}" for label, value in rows]
    for stage, q in p["stages"].items():
        lines.append(f"  {'  ' + stage:<32} p50 {q['p50_ms']:.2f} ms  p99 {q['p99_ms']:.2f} ms")
    if s.get("drain_note"):
        lines.append(f"  note: {s['drain_note']}")
    return "\n".join(lines)


def write_summary(summary: Mapping[str, Any], opts: ModelBenchOptions) -> Path:
    """The results file (and ``--json``), each written whole or not at all: a
    run stopped while writing leaves no torn result behind."""
    day = dt.date.fromisoformat(summary["date"])
    path = results_path(
        opts.results_dir, day, summary["device"], summary["payload"], summary["procs"]
    )
    text = (json.dumps(summary, indent=2) + "\n").encode()
    atomic_write(path, text)
    if opts.json_out:
        atomic_write(Path(opts.json_out), text)
    return path
