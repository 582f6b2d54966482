"""``infer-worker compare``: options, configuration, exit status."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from typing import Any

from worker.config import KafkaConfig, load_settings
from worker.flow.errors import ConfigError
from worker.kafka.clients import read_isolation
from worker.kafka.credentials import connection
from worker.kafka.diagnose import run_tool
from worker.ops.compare import plot
from worker.ops.compare.gates import Thresholds, gates
from worker.ops.compare.join import Comparison
from worker.ops.compare.read import read_results
from worker.ops.compare.results import Side
from worker.ops.topics import offsets_since
from worker.ops.verify.cli import add_reading_arguments, emit, results_registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compare`` command's options. The connection (brokers, security)
    comes from ``--config`` (file plus ``INFER_WORKER_*`` overrides, as ``run``
    reads them) or the defaults; the topics are always named."""
    parser.add_argument(
        "--config", help="TOML file to take the brokers and security settings from (flags win)"
    )
    parser.add_argument("--bootstrap-servers", help="host:port[,host:port...]")
    parser.add_argument(
        "--baseline", required=True, metavar="TOPIC",
        help="the result topic of the model in production",
    )  # fmt: skip
    parser.add_argument(
        "--candidate", required=True, metavar="TOPIC",
        help="the result topic of the candidate (a shadow worker's kafka.output_topic)",
    )  # fmt: skip
    parser.add_argument(
        "--input-topic", metavar="TOPIC",
        help="the request topic both read: labels come from its requests' meta, and the "
        "coverage counts its requests",
    )  # fmt: skip
    parser.add_argument(
        "--label-key", metavar="KEY",
        help="report each side's top-1 accuracy against meta[KEY], a class index (from "
        "--input-topic's requests, else from the meta the results echo)",
    )  # fmt: skip
    parser.add_argument(
        "--since", metavar="TIME", type=since_ms,
        help="compare only requests written at or after TIME (ISO 8601, e.g. "
        "2026-11-26T13:00:00Z, or seconds since the epoch): the shadow's start, so a "
        "backlog it read late is left out; the requests are --input-topic's, else the "
        "config's kafka.input_topics",
    )  # fmt: skip
    parser.add_argument(
        "--top-k", type=int, default=3, metavar="K",
        help="top-k agreement over the top K classes (default 3; at most what a "
        "topk_indices output holds)",
    )  # fmt: skip
    checks = parser.add_argument_group("thresholds (exit 1 when one is not met)")
    checks.add_argument(
        "--min-top1",
        type=float,
        metavar="RATE",
        help="least top-1 agreement of every classifier-like output (0..1)",
    )
    checks.add_argument(
        "--min-topk",
        type=float,
        metavar="RATE",
        help="least top-k agreement of every classifier-like output (0..1)",
    )
    checks.add_argument(
        "--max-abs-diff",
        type=float,
        metavar="X",
        help="largest absolute difference allowed in any output",
    )
    checks.add_argument(
        "--min-cosine",
        type=float,
        metavar="X",
        help="least mean cosine similarity of every output (-1..1)",
    )
    checks.add_argument(
        "--min-coverage",
        type=float,
        metavar="RATE",
        help="least share of results joined: joined / the larger side (0..1)",
    )
    checks.add_argument("--max-error-diff", type=int, metavar="N",
                        help="most requests whose status or error code may differ")  # fmt: skip
    parser.add_argument(
        "--plot", metavar="PATH", help="also draw the report as a PNG (needs matplotlib)"
    )
    add_reading_arguments(parser)


def since_ms(text: str) -> int:
    """``--since``: an ISO 8601 time (no zone: UTC) or seconds since the epoch,
    as Kafka timestamps (milliseconds)."""
    try:
        return round(float(text) * 1000)
    except ValueError:
        pass
    try:
        at = datetime.datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an ISO 8601 time (2026-11-26T13:00:00Z) or epoch seconds"
        ) from exc
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    return round(at.timestamp() * 1000)


def _kafka_config(args: argparse.Namespace) -> KafkaConfig:
    base = load_settings(args.config).kafka  # INFER_WORKER_KAFKA__* too: security
    if args.bootstrap_servers is not None:
        base = dataclasses.replace(base, bootstrap_servers=args.bootstrap_servers)
    return base


def _thresholds(args: argparse.Namespace) -> Thresholds:
    """The thresholds given, each checked against the range it can take."""
    for flag, value, low, high in (
        ("--min-top1", args.min_top1, 0.0, 1.0),
        ("--min-topk", args.min_topk, 0.0, 1.0),
        ("--min-coverage", args.min_coverage, 0.0, 1.0),
        ("--min-cosine", args.min_cosine, -1.0, 1.0),
        ("--max-abs-diff", args.max_abs_diff, 0.0, float("inf")),
        ("--max-error-diff", args.max_error_diff, 0, float("inf")),
    ):
        if value is not None and not low <= value <= high:
            raise ConfigError(f"{flag} {value}: must be in [{low}, {high}]")
    return Thresholds(
        min_top1=args.min_top1, min_topk=args.min_topk, max_abs_diff=args.max_abs_diff,
        min_cosine=args.min_cosine, min_coverage=args.min_coverage,
        max_error_diff=args.max_error_diff,
    )  # fmt: skip


def _check_usage(args: argparse.Namespace) -> None:
    topics = [args.baseline, args.candidate, *([args.input_topic] if args.input_topic else [])]
    if not all(t.strip() for t in topics):
        raise ConfigError("topic names must not be empty")
    if len(set(topics)) < len(topics):
        raise ConfigError("--baseline, --candidate and --input-topic must name different topics")
    if args.top_k < 1:
        raise ConfigError("--top-k must be >= 1")
    if not (args.idle_timeout > 0 and args.timeout > 0):
        raise ConfigError("--idle-timeout and --timeout must be > 0")
    if args.plot and not plot.available():
        raise ConfigError(
            "--plot needs matplotlib, which is not installed: `pip install "
            "'infer-worker[plot]'` (or matplotlib), or leave --plot out"
        )


def run(args: argparse.Namespace) -> int:
    """Read, compare, print. Exit status: 0 every threshold met; 1 a threshold
    not met, or the topics never went quiet within ``--timeout``; 2 usage or
    configuration errors, including topics that cannot be read."""
    try:
        _check_usage(args)
        thresholds = _thresholds(args)
        kafka = _kafka_config(args)
        conn = connection(kafka)  # reads secret files: a missing one is exit 2 too
    except ConfigError as exc:
        print(f"infer-worker compare: configuration error: {exc}", file=sys.stderr)
        return 2
    topics: dict[Side, str] = {"baseline": args.baseline, "candidate": args.candidate}
    try:
        since = None
        if args.since is not None:
            requests = [args.input_topic] if args.input_topic else list(kafka.input_topics)
            since = run_tool(kafka, offsets_since(conn, requests, args.since))
        comparison = Comparison(top_k=args.top_k, label_key=args.label_key, since=since)
        complete = run_tool(
            kafka,
            read_results(
                conn, topics, comparison,
                input_topic=args.input_topic, label_key=args.label_key,
                idle_timeout=args.idle_timeout, timeout=args.timeout,
                isolation_level=read_isolation(kafka, args.read_committed),
                registry=results_registry(args),
            )
        )  # fmt: skip
    except ConfigError as exc:  # Kafka refused or missed the settings (``run_tool``), or a
        # topic cannot be read (``TopicUnreadable``)
        print(f"infer-worker compare: configuration error: {exc}", file=sys.stderr)
        return 2
    report = comparison.report(topics)
    decided = gates(report, thresholds)
    missed = [problem for gate in decided for problem in gate.problems]
    doc: dict[str, Any] = {
        **report.to_dict(),
        "complete": complete,
        "thresholds": {k: v for k, v in dataclasses.asdict(thresholds).items() if v is not None},
        "failures": missed,
        "bootstrap_servers": kafka.bootstrap_servers,
    }
    emit(report.format(), doc, args.json)
    if args.plot:
        plot.write_plot(report, decided, args.plot)
    for reason in missed:
        print(f"infer-worker compare: threshold not met: {reason}", file=sys.stderr)
    if not complete:
        print(
            f"infer-worker compare: topics still busy after {args.timeout}s; "
            "the report covers only what was read",
            file=sys.stderr,
        )
        return 1
    return 1 if missed else 0
