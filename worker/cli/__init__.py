"""Command line: ``infer-worker run | produce | consume | demo | bench | config |
verify | build-engine``. Each command's parser and handler live in one module
beside its kind of work (serve, client, bench, tools); this one only builds the
root parser and dispatches. Nothing but argument parsing happens at import time:
each handler imports its feature when it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from worker import __version__
from worker.cli.bench import add_demo_and_bench
from worker.cli.client import add_client
from worker.cli.serve import add_run
from worker.cli.tools import add_tools
from worker.flow.errors import ConfigError, WorkerError

DESCRIPTION = """\
Serve a model to a Kafka stream: requests (msgpack or Open Inference Protocol
JSON: images, texts, tensors) are read from input topics, batched, run, and
answered on an output topic; records that cannot be answered go to a dead-letter
topic. Input offsets are committed only after the answers were acknowledged by
the broker."""

EPILOG = """\
first steps, without Docker or Kafka (each in its own terminal):
  infer-worker run --embedded       embedded broker + topics + a worker
  infer-worker produce --samples 3  send 3 bundled digits, print their answers
  infer-worker produce digit.png    send your own image (JPEG, PNG, WebP, .npy)

more:
  infer-worker demo                          end-to-end self-check, prints a summary
  infer-worker run --config worker.toml      serve against your Kafka
  infer-worker verify --config worker.toml   were all requests answered?

settings: a TOML file (--config) and/or INFER_WORKER_<SECTION>__<KEY> variables,
e.g. INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS=kafka:9092; `infer-worker config`
prints the result."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infer-worker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run(sub)
    add_client(sub)
    add_demo_and_bench(sub)
    add_tools(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the command, and map its errors to exit status 2 (configuration) or 1."""
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
