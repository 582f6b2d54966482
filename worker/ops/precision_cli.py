"""``build-engine --backend onnxruntime``'s options and exit status (the build
itself is ``worker.ops.precision``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from worker.config import load_settings
from worker.flow.errors import ConfigError, WorkerError
from worker.ops.precision import PrecisionBuild, build_precision

EXIT_FAILED = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "--backend onnxruntime (the CPU path: --precision int8 or fp16; --config, --out-dir "
        "and --force apply)"
    )
    group.add_argument(
        "--out", type=Path, default=None, metavar="FILE",
        help="write the model here (default OUT_DIR/<key>.onnx); its build record goes "
        "beside it as FILE.build.json",
    )  # fmt: skip
    group.add_argument(
        "--calibration-files", type=Path, nargs="+", default=(), metavar="PATH",
        help="int8: samples as requests carry them: .npy (stacked on axis 0), .npz (one "
        "array per request input), image files, or directories of those; preprocessed "
        "as the worker serves them (fp16: optional, for the agreement check only)",
    )  # fmt: skip
    group.add_argument(
        "--calibration-topic", default=None, metavar="TOPIC",
        help="int8: calibrate on the requests of this topic, read from the beginning "
        "without a consumer group (brokers and security from --config)",
    )  # fmt: skip
    group.add_argument(
        "--calibration-count", type=int, default=256, metavar="N",
        help="at most N calibration samples (default 256)",
    )  # fmt: skip
    group.add_argument(
        "--bootstrap-servers", default=None, metavar="HOSTS",
        help="--calibration-topic's brokers (default: --config's kafka.bootstrap_servers)",
    )  # fmt: skip
    group.add_argument(
        "--per-tensor", action="store_true",
        help="int8: one scale per weight tensor instead of one per output channel",
    )  # fmt: skip
    group.add_argument(
        "--quantize-ops", default=None, metavar="OPS",
        help="int8: the op types to quantize, comma-separated, or 'all' (every op the "
        "quantizer handles); default: Conv, ConvTranspose, Gemm, MatMul",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Prints the model's path. Exit 0 built or cached; 1 the build failed; 2 usage,
    configuration or calibration errors (the message names the flag or setting)."""
    try:
        settings = load_settings(args.config)
        settings = dataclasses.replace(
            settings,
            model=dataclasses.replace(settings.model, path=args.model, backend="onnxruntime"),
        )
        if args.bootstrap_servers is not None:
            kafka = dataclasses.replace(settings.kafka, bootstrap_servers=args.bootstrap_servers)
            settings = dataclasses.replace(settings, kafka=kafka)
        request = PrecisionBuild(
            settings, args.precision, out_dir=args.out_dir, out=args.out,
            calibration_files=tuple(args.calibration_files),
            calibration_topic=args.calibration_topic,
            calibration_count=args.calibration_count,
            per_channel=not args.per_tensor, force=args.force,
            quantize_ops=_ops(args.quantize_ops),
        )  # fmt: skip
        built = build_precision(request)
    except ConfigError as exc:
        print(f"build-engine: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerError as exc:
        print(f"build-engine: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(built.path)
    return 0


def _ops(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    if text.strip() == "all":
        return ()
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    if not ops:
        raise ConfigError("--quantize-ops: name op types (Conv,MatMul) or 'all'")
    return ops
