"""Command line: ``infer-worker run | demo | bench | config | verify | build-engine``.

settings -> logging -> asyncio.run; nothing else happens at import time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence

import structlog

from worker import __version__, logs
from worker.config import Settings, load_settings, redacted
from worker.errors import ConfigError, WorkerError

log = structlog.get_logger("worker")


async def serve(settings: Settings) -> int:
    """Run one worker until SIGTERM/SIGINT (drain, commit, leave) or a fatal error.

    A second signal abandons the drain: in-flight work is not committed and will
    be redelivered to the group.
    """
    from worker.pipeline.worker import Worker

    if settings.metrics.port:
        from worker.metrics import serve_http

        serve_http(settings.metrics.port, settings.metrics.host)

    loop = asyncio.get_running_loop()
    signals = 0
    stop_requested = asyncio.Event()
    worker = Worker(settings)

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        log.info("signal", signal=signal.Signals(signum).name, count=signals)
        stop_requested.set()
        if signals > 1:
            worker.abandon()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    await worker.start()
    waiter = asyncio.ensure_future(worker.wait())
    stopper = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    stopper.cancel()
    drained = await worker.stop()
    if worker.failure is not None:
        log.error("worker_failed", error=repr(worker.failure))
        return 1
    return 0 if drained and signals <= 1 else 2


def _cmd_run(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    logs.configure(settings.logging)
    log.info("starting", version=__version__, config=args.config)
    return asyncio.run(serve(settings))


def _cmd_config(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    print(json.dumps(redacted(settings), indent=2))
    return 0


def _parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out[key.strip()] = value.strip()
    return out


def _cmd_demo(args: argparse.Namespace) -> int:
    """``demo``, and ``bench`` (the same run, then the naive baseline)."""
    from worker.tools.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            repeat=args.repeat,
            partitions=args.partitions,
            json_out=args.json,
            baseline=args.command == "bench",
            rate=args.rate,
            overrides=_parse_sets(args.set),
        )
    )


def _cmd_build_engine(args: argparse.Namespace) -> int:
    from worker.config import LoggingConfig
    from worker.tools import build_engine

    logs.configure(LoggingConfig(format="console", level="info"))  # stderr; stdout = results
    return build_engine.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer-worker", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve the configured model to Kafka until SIGTERM")
    run.add_argument("--config", help="TOML file (environment INFER_WORKER_* overrides it)")
    run.set_defaults(func=_cmd_run)

    cfg = sub.add_parser("config", help="print the effective configuration (secrets masked)")
    cfg.add_argument("--config", help="TOML file")
    cfg.set_defaults(func=_cmd_config)

    for name, func, helptext, repeat in (
        ("demo", _cmd_demo, "embedded broker + worker + labelled samples; prints a summary", 10),
        (
            "bench",
            _cmd_demo,
            "the demo, then a naive one-at-a-time baseline; prints the ratio",
            20,
        ),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument(
            "--repeat",
            type=int,
            default=repeat,
            help="send the held-out sample set this many times (at varying sizes)",
        )
        p.add_argument("--partitions", type=int, default=4, help="input topic partitions")
        p.add_argument(
            "--rate",
            type=float,
            default=0.0,
            help="requests per second (default: as fast as possible)",
        )
        p.add_argument("--json", help="also write the summary as JSON to this file")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="worker setting for this run, e.g. batching.max_batch_size=16",
        )
        p.set_defaults(func=func)

    from worker.tools import verify

    ver = sub.add_parser(
        "verify",
        help="read input, output and DLQ topics; report lost, duplicated and reordered answers",
    )
    verify.add_arguments(ver)
    ver.set_defaults(func=verify.run)

    from worker.tools import build_engine

    build = sub.add_parser(
        "build-engine",
        help="build a TensorRT plan from ONNX (optimisation profiles, precision, caches)",
    )
    build_engine.add_arguments(build)
    build.set_defaults(func=_cmd_build_engine)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"infer-worker: configuration error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"infer-worker: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
