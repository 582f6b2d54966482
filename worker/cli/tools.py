"""``infer-worker config``, ``verify`` and ``build-engine``: the operator's tools."""

from __future__ import annotations

import argparse
import json

from worker.cli.common import Subparsers, add_command
from worker.config import load_settings, redacted
from worker.obs import logs


def config_command(args: argparse.Namespace) -> int:
    print(json.dumps(redacted(load_settings(args.config)), indent=2))
    return 0


def build_engine_command(args: argparse.Namespace) -> int:
    from worker.config import LoggingConfig
    from worker.ops import build_engine

    logs.configure(LoggingConfig(format="console", level="info"))  # stderr; stdout = results
    return build_engine.run(args)


def add_tools(sub: Subparsers[argparse.ArgumentParser]) -> None:
    cfg = add_command(
        sub, "config", "print the effective configuration (secrets masked)",
        "Print the settings the worker would run with: defaults, then --config, then "
        "INFER_WORKER_* variables, as JSON with secrets masked.",
        config_command,
    )  # fmt: skip
    cfg.add_argument("--config", help="TOML file")

    from worker.ops import build_engine, verify

    ver = add_command(
        sub, "verify", "report lost, duplicated and reordered answers",
        "Read the input, output and DLQ topics from the beginning (no consumer group) and "
        "report, per input partition, requests without an answer, answered twice, or "
        "answered out of order. Exit 0 all answered; 1 something lost (or duplicated "
        "with --strict); 2 the check could not be made.",
        verify.run,
    )  # fmt: skip
    verify.add_arguments(ver)
    build = add_command(
        sub, "build-engine", "build a TensorRT plan from ONNX (cached)",
        "Build a TensorRT plan from an ONNX model with one optimisation profile per GPU "
        "slot, at the given precision, cached under a key of the model, TensorRT version, "
        "GPU, precision and batch range. Needs TensorRT 10 (exit 2 without it).",
        build_engine_command,
    )  # fmt: skip
    build_engine.add_arguments(build)
