"""INT8 and FP16 on the CPU path (issue 30): engine-alone speed, agreement with
float32 and accuracy, for the bundled digits model and a real OCR recogniser.

    .venv/bin/python -m benchmarks.precision [--models digits,ppocr-rec] [--threads 1,2]
        [--repeats 5] [--seconds 2] [--json out.json]

Each model is built at fp16 and int8 (per output channel, and per tensor) by
``worker.ops.precision`` (what ``build-engine --backend onnxruntime`` runs),
calibrated on samples turned into engine feeds by the worker's own binding,
then every precision runs in ``OnnxRuntimeEngine`` (the worker's CPU engine,
``intra_op_threads`` as given) on the same evaluation batches:

* ``digits`` (builtin:digits): calibrated on the first 180 of the 360 held-out
  samples (``digits_samples.npz``, ``--calibration-count 180``), evaluated on all
  360 (and on the 180 not calibrated on) against their labels; batches of 32.
* ``ppocr-rec`` (PP-OCRv4 text recogniser, tests/real_models.py): float32
  [3, 48, 320] crops of random ASCII strings rendered with Pillow's bundled font
  at several sizes and greys, normalised as PaddleOCR does ((x/255 - 0.5)/0.5),
  served as tensors; 64 crops calibrate, 256 others are evaluated (batches of 8).
  Agreement per time step (top-1 of the 6625 classes) and per crop (the CTC
  decoded string equal), accuracy = the decoded string equals the rendered text.

Speed: for each repeat, each precision in turn (rotated) runs the evaluation
batches for at least ``--seconds``; rows/s per repeat, its ratio against fp32 of
the same repeat, median over repeats. Benchmark code: not part of the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.compute.engines.onnxruntime import OnnxRuntimeEngine
from worker.config import ModelConfig, Settings
from worker.model.files import bundled_file, resolve_model_path
from worker.model.inputs import bind_model
from worker.ops.calibration import from_files
from worker.ops.precision import PrecisionBuild, build_precision

Feeds = dict[str, np.ndarray]
VARIANTS: dict[str, dict[str, Any]] = {  # name -> PrecisionBuild fields
    "fp16": {"precision": "fp16"},
    "int8": {"precision": "int8"},  # the default: weighted ops, per channel, reduced range
    "int8-full-range": {"precision": "int8", "reduce_range": False},
    "int8-per-tensor": {"precision": "int8", "per_channel": False},
    "int8-all-ops": {"precision": "int8", "quantize_ops": ()},
}


@dataclass
class Workload:
    name: str
    model: ModelConfig
    calibration: Path  # a file of samples as requests carry them
    calibration_count: int
    batches: list[Feeds]  # evaluation feeds, as the worker makes them
    score: Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], dict[str, Any]]


# --- digits -------------------------------------------------------------------------


def digits(tmp: Path) -> Workload:
    model = ModelConfig()
    feeds = _feeds(model, bundled_file("digits_samples.npz"), 360, 32)
    with np.load(bundled_file("digits_samples.npz")) as data:
        labels = np.asarray(data["labels"])

    def score(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, Any]:
        r, g = ref["logits"], got["logits"]
        same = r.argmax(1) == g.argmax(1)
        right = g.argmax(1) == labels
        return {
            "top1_agreement": float(same.mean()),
            "top1_agreement_uncalibrated_180": float(same[180:].mean()),
            "max_abs_diff": float(np.abs(r - g).max()),
            "accuracy": float(right.mean()),
            "accuracy_uncalibrated_180": float(right[180:].mean()),
            "rows": len(labels),
        }

    return Workload("digits", model, bundled_file("digits_samples.npz"), 180, feeds,
                    score)  # fmt: skip


# --- PP-OCRv4 recogniser -----------------------------------------------------------

ALPHABET = string.ascii_letters + string.digits


def render(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[str]]:
    """``n`` crops [3, 48, 320] of random strings, normalised as PaddleOCR does."""
    from PIL import Image, ImageDraw, ImageFont

    crops, texts = [], []
    for _ in range(n):
        text = "".join(rng.choice(list(ALPHABET), int(rng.integers(4, 13))))
        size = int(rng.integers(22, 31))
        font = ImageFont.load_default(size=size)
        ink, paper = int(rng.integers(0, 80)), int(rng.integers(190, 256))
        img = Image.new("RGB", (320, 48), (paper,) * 3)
        ImageDraw.Draw(img).text(
            (int(rng.integers(2, 12)), int(rng.integers(2, 48 - size - 4))), text,
            fill=(ink,) * 3, font=font,
        )  # fmt: skip
        x = (np.asarray(img, np.float32) / 255.0 - 0.5) / 0.5
        crops.append(x.transpose(2, 0, 1))
        texts.append(text)
    return np.ascontiguousarray(np.stack(crops)), texts


def ctc(indices: np.ndarray) -> tuple[int, ...]:
    """Greedy CTC: repeats collapsed, blanks (0) dropped."""
    out, prev = [], -1
    for i in indices.tolist():
        if i not in (prev, 0):
            out.append(i)
        prev = i
    return tuple(out)


def ppocr_rec(tmp: Path) -> Workload:
    from tests import real_models

    path = real_models.fetch(real_models.MODELS["ppocr-rec"])
    model = ModelConfig(path=str(path))
    calib, _ = render(np.random.default_rng(1), 64)
    np.save(tmp / "rec-calibration.npy", calib)
    crops, texts = render(np.random.default_rng(2), 256)
    np.save(tmp / "rec-eval.npy", crops)
    feeds = _feeds(model, tmp / "rec-eval.npy", len(crops), 8)
    import onnxruntime as ort

    chars = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    keys = ["", *chars.get_modelmeta().custom_metadata_map["character"].splitlines(), " "]

    def score(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, Any]:
        (name,) = ref
        r, g = ref[name], got[name]
        ri, gi = r.argmax(-1), g.argmax(-1)
        rs, gs = [ctc(row) for row in ri], [ctc(row) for row in gi]
        decoded = ["".join(keys[i] for i in s) for s in gs]
        return {
            "top1_agreement_per_step": float((ri == gi).mean()),
            "string_agreement": float(np.mean([a == b for a, b in zip(rs, gs, strict=True)])),
            "max_abs_diff": float(np.abs(r - g).max()),
            "accuracy": float(np.mean([d == t for d, t in zip(decoded, texts, strict=True)])),
            "rows": len(texts),
        }

    return Workload("ppocr-rec", model, tmp / "rec-calibration.npy", 64, feeds,
                    score)  # fmt: skip


# --- magika ------------------------------------------------------------------------

WHITESPACE = b"\t\n\v\f\r "


def magika_features(data: bytes, size: int = 1024, block: int = 4096, pad: int = 256
                    ) -> np.ndarray:  # fmt: skip
    """magika's standard_v3_3 input (its config.min.json): the first ``size`` bytes
    of the leading block after leading whitespace, padded after, and the last
    ``size`` of the trailing block before trailing whitespace, padded before."""
    beg = list(data[:block].lstrip(WHITESPACE)[:size])
    end = list(data[-block:].rstrip(WHITESPACE)[-size:])
    row = beg + [pad] * (size - len(beg)) + [pad] * (size - len(end)) + end
    return np.asarray(row, np.int32)


def corpus(n: int, seed: int) -> list[Path]:
    """Files of this machine's virtual environment, up to 24 of each extension
    (Python, JSON, shared objects, C headers, protobufs, ONNX, text, ...)."""
    import glob

    root = Path(sys.prefix) / "lib"
    by_ext: dict[str, list[Path]] = {}
    for name in sorted(glob.glob(str(root / "**" / "*"), recursive=True)):
        p = Path(name)
        if p.is_file() and not p.is_symlink() and p.stat().st_size >= 8:
            by_ext.setdefault(p.suffix, []).append(p)
    rng = np.random.default_rng(seed)
    picked = [p for ext in sorted(by_ext) for p in rng.permutation(by_ext[ext])[:24]]
    return [Path(p) for p in rng.permutation(picked)[:n]]


def magika(tmp: Path) -> Workload:
    from tests import real_models

    path = real_models.fetch(real_models.MODELS["magika"])
    model = ModelConfig(path=str(path))
    files = corpus(640, seed=0)
    rows = np.stack([magika_features(f.read_bytes()) for f in files])
    np.save(tmp / "magika-calibration.npy", rows[:128])
    np.save(tmp / "magika-eval.npy", rows[128:])
    feeds = _feeds(model, tmp / "magika-eval.npy", len(rows) - 128, 32)

    def score(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, Any]:
        r, g = ref["target_label"], got["target_label"]
        return {
            "top1_agreement": float((r.argmax(1) == g.argmax(1)).mean()),
            "max_abs_diff": float(np.abs(r - g).max()),
            "classes_predicted_fp32": len(set(r.argmax(1).tolist())),
            "rows": len(r),
        }

    return Workload("magika", model, tmp / "magika-calibration.npy", 128, feeds, score)


def _feeds(model: ModelConfig, samples: Path, count: int, batch: int) -> list[Feeds]:
    """Evaluation batches made by the worker's binding, as it serves them."""
    engine = OnnxRuntimeEngine(resolve_model_path(model.path), model)
    inputs = bind_model(model, engine.info.io, Settings().limits).inputs
    return list(from_files((samples,), inputs, count, batch).runs)


# --- running -----------------------------------------------------------------------


def outputs(engine: OnnxRuntimeEngine, batches: list[Feeds]) -> dict[str, np.ndarray]:
    runs = [engine.run(b) for b in batches]
    return {k: np.concatenate([r[k] for r in runs]) for k in runs[0]}


def rows_per_s(engine: OnnxRuntimeEngine, batches: list[Feeds], seconds: float) -> float:
    rows = 0
    start = time.perf_counter()
    while True:
        for b in batches:
            engine.run(b)
            rows += len(next(iter(b.values())))
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return rows / elapsed


def measure(w: Workload, tmp: Path, threads: list[int], repeats: int, seconds: float,
            variants: list[str]) -> dict[str, Any]:  # fmt: skip
    settings = dataclasses.replace(Settings(), model=w.model)
    paths = {"fp32": resolve_model_path(w.model.path)}
    builds: dict[str, Any] = {}
    for variant in variants:
        fields = VARIANTS[variant]
        int8 = fields["precision"] == "int8"
        built = build_precision(
            PrecisionBuild(
                settings, out_dir=tmp / "engines", force=True,
                calibration_files=(w.calibration,) if int8 else (),
                calibration_count=w.calibration_count, **fields,
            )
        )  # fmt: skip
        paths[variant] = built.path
        r = built.record
        builds[variant] = {k: r[k] for k in ("model_version", "options", "build_seconds",
                                             "agreement_with_float32")}  # fmt: skip
        builds[variant]["bytes"] = r["output"]["bytes"]
        builds[variant]["calibration_samples"] = (r["calibration"] or {}).get("samples")
    result: dict[str, Any] = {"builds": builds, "bytes_fp32": paths["fp32"].stat().st_size}
    reference = None
    quality: dict[str, Any] = {}
    for variant, path in paths.items():
        engine = OnnxRuntimeEngine(path, dataclasses.replace(w.model, path=str(path)))
        got = outputs(engine, w.batches)
        reference = reference or got
        quality[variant] = w.score(reference, got)
    result["quality"] = quality
    speed: dict[str, Any] = {}
    for n in threads:
        engines = {
            v: OnnxRuntimeEngine(p, dataclasses.replace(w.model, path=str(p), intra_op_threads=n))
            for v, p in paths.items()
        }
        for e in engines.values():  # warm: first runs allocate
            outputs(e, w.batches[:2])
        per: dict[str, list[float]] = {v: [] for v in engines}
        order = list(engines)
        for r in range(repeats):
            for v in order[r % len(order) :] + order[: r % len(order)]:
                per[v].append(rows_per_s(engines[v], w.batches, seconds))
            print(f"{w.name} threads={n} repeat {r}: "
                  + ", ".join(f"{v} {per[v][-1]:.0f}" for v in order), file=sys.stderr)  # fmt: skip
        speed[f"threads={n}"] = {
            v: {
                "rows_per_s_median": statistics.median(xs),
                "rows_per_s": [round(x, 1) for x in xs],
                "ratio_vs_fp32_median": statistics.median(
                    x / f for x, f in zip(xs, per["fp32"], strict=True)
                ),
                "ratio_vs_fp32": [round(x / f, 3) for x, f in zip(xs, per["fp32"], strict=True)],
            }
            for v, xs in per.items()
        }
    result["speed"] = speed
    result["batch_rows"] = len(next(iter(w.batches[0].values())))
    result["eval_rows"] = sum(len(next(iter(b.values()))) for b in w.batches)
    return result


# --- end to end: an int8 shadow beside fp32 production, judged by compare -----------


async def shadow_compare(tmp: Path, out: Path, repeat: int) -> dict[str, Any]:
    """fp32 production and an int8 shadow (builds with build-engine's CLI) on one
    input topic of the labelled digits on the embedded broker; ``infer-worker
    compare``'s JSON report on their result topics."""
    import asyncio
    import subprocess

    from worker.ops.broker import EmbeddedBroker, create_topics
    from worker.ops.processes import spawn_worker
    from worker.ops.samples import encode_samples, labelled_samples
    from worker.ops.topics import Collector, produce_all

    int8 = tmp / "digits-int8.onnx"
    build = [sys.executable, "-m", "worker", "build-engine", "--backend", "onnxruntime",
             "builtin:digits", "--precision", "int8", "--calibration-files",
             str(bundled_file("digits_samples.npz")), "--calibration-count", "180",
             "--out", str(int8)]  # fmt: skip
    await asyncio.to_thread(subprocess.run, build, check=True, capture_output=True)
    requests = encode_samples(labelled_samples(repeat))
    with EmbeddedBroker() as broker:
        topics = {"in": "p.requests", "fp32": "p.results", "int8": "p.results.int8",
                  "dlq": "p.dlq"}  # fmt: skip
        await create_topics(broker.bootstrap, {topics["in"]: 2, topics["fp32"]: 1,
                                               topics["int8"]: 1, topics["dlq"]: 1})  # fmt: skip
        shadow = {"INFER_WORKER_KAFKA__SHADOW": "true", "INFER_WORKER_MODEL__PATH": str(int8),
                  "INFER_WORKER_MODEL__INPUT": "image"}  # fmt: skip
        workers = [
            spawn_worker(broker.bootstrap, input_topics=[topics["in"]], output_topic=topics[side],
                         dlq_topic=topics["dlq"], group_id=f"p.{side}", extra_env=env)
            for side, env in (("fp32", {}), ("int8", shadow))
        ]  # fmt: skip
        try:
            for w in workers:
                await asyncio.to_thread(
                    w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 2, 60.0,
                    "partition assignment",
                )  # fmt: skip
            await produce_all(broker.bootstrap, topics["in"], requests)
            c = Collector(broker.bootstrap, [topics["fp32"], topics["int8"]])
            await c.start()
            try:
                await c.collect(lambda c: c.count() >= 2 * len(requests), 300)
            finally:
                await c.stop()
        finally:
            for w in workers:
                w.terminate()
        cmd = [sys.executable, "-m", "worker", "compare", "--bootstrap-servers",
               broker.bootstrap, "--baseline", topics["fp32"], "--candidate", topics["int8"],
               "--input-topic", topics["in"], "--label-key", "label", "--min-top1", "0.99",
               "--min-coverage", "1", "--max-error-diff", "0", "--json", str(out)]  # fmt: skip
        done = await asyncio.to_thread(
            subprocess.run, cmd, check=False, capture_output=True, text=True
        )
    report: dict[str, Any] = json.loads(await asyncio.to_thread(out.read_text))
    report["exit_status"] = done.returncode
    report["requests"] = len(requests)
    report["commands"] = {"build": " ".join(build[2:]), "compare": " ".join(cmd[2:])}
    return report


WORKLOADS = {"digits": digits, "magika": magika, "ppocr-rec": ppocr_rec}


def main() -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="digits,magika,ppocr-rec")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS),
        help=f"builds to measure against fp32, of {', '.join(VARIANTS)}",
    )  # fmt: skip
    parser.add_argument("--threads", default="1,2", help="intra_op_threads to time at")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per precision per repeat")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--compare", type=Path, default=None, metavar="JSON",
        help="instead: fp32 production and an int8 shadow on the embedded broker, "
        "infer-worker compare's report written here",
    )  # fmt: skip
    parser.add_argument("--compare-repeat", type=int, default=3,
                        help="the 360 digits this many times (8x8, 16x16, 24x24)")  # fmt: skip
    args = parser.parse_args()
    if args.compare is not None:
        import asyncio

        from worker.ops.children import children_die_with_this_process

        with tempfile.TemporaryDirectory() as tmp, children_die_with_this_process("precision"):
            report = asyncio.run(shadow_compare(Path(tmp), args.compare, args.compare_repeat))
        report["command"] = "python -m benchmarks.precision " + " ".join(sys.argv[1:])
        args.compare.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    doc: dict[str, Any] = {
        "command": "python -m benchmarks.precision " + " ".join(sys.argv[1:]),
        "onnxruntime": ort.__version__,
        "cpus": os.cpu_count(),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            w = WORKLOADS[name](Path(tmp))
            doc["models"][name] = measure(
                w, Path(tmp), threads, args.repeats, args.seconds, args.variants.split(",")
            )
    text = json.dumps(doc, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
