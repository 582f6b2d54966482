"""``infer-worker run``: serve the configured model (one process, a group, or embedded)."""

from __future__ import annotations

import argparse
import asyncio
import os

import structlog

from worker import __version__
from worker.cli.common import Subparsers, add_command
from worker.config import load_settings
from worker.config.models import as_served
from worker.flow.errors import ConfigError
from worker.obs import logs

log = structlog.get_logger("worker")

RUN_DESCRIPTION = """\
Serve the configured model until SIGTERM or Ctrl-C, then drain: stop fetching,
finish in-flight batches, await acknowledgements, commit and leave the group
(within shutdown.drain_timeout_ms; a second signal gives up draining).

Without --config, the built-in defaults apply (Kafka at localhost:9092, topics
infer.requests -> infer.results, errors to infer.dlq, the bundled digits model
on the CPU), each overridable by an INFER_WORKER_<SECTION>__<KEY> variable. The
input topics must exist (--embedded creates them).

exit status: 0 drained and stopped; 1 a stage failed (engine dead, delivery
failed for good, failure budget exceeded); 2 a configuration error (the message
names the setting) or a stop without draining."""


def run_command(args: argparse.Namespace) -> int:
    # One model, whichever section configured it, runs as one model (lanes in
    # processes of their own, the GPU's members): worker.config.models.as_served.
    configured = load_settings(args.config)
    settings = as_served(configured)
    # kafka.client_id names the member: run --procs N gives member i "<client_id>-i".
    logs.configure(settings.logging, pid=os.getpid(), member=settings.kafka.client_id)
    log.info("starting", version=__version__, config=args.config, embedded=args.embedded)
    if args.procs < 1:
        raise ConfigError(f"--procs: must be >= 1, got {args.procs}")
    if args.embedded:
        from worker.cli.local import run_embedded

        return run_embedded(configured, args.partitions, args.procs, args.config)
    from worker.app.supervisor import supervise, supervised

    if supervised(settings, args.procs):  # --procs N, or lanes of their own
        return supervise(settings, args.procs, args.config)
    from worker.app.service import serve

    # The worker is given every model's configuration: it runs one model as one
    # model itself, and the control topic may bring models beside it.
    return asyncio.run(serve(configured))


def add_run(sub: Subparsers[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "run", "serve the model to Kafka until SIGTERM / Ctrl-C", RUN_DESCRIPTION,
        run_command,
        epilog="examples:\n  infer-worker run --embedded\n"
        "  INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS=kafka:9092 infer-worker run\n"
        "  infer-worker run --config worker.toml --procs 4",
    )  # fmt: skip
    p.add_argument("--config", help="TOML file (INFER_WORKER_* variables override it)")
    p.add_argument(
        "--embedded",
        action="store_true",
        help="also start the embedded broker (localhost:9092, or a free port it names) "
        "and create the configured topics; for trying the worker without Kafka",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        help="worker processes in the group, on this host (default 1); metrics on "
        "metrics.port + i. One process uses about one core for its per-record work",
    )
    p.add_argument(
        "--partitions",
        type=int,
        default=4,
        help="with --embedded: partitions of the input and output topics (default 4)",
    )
