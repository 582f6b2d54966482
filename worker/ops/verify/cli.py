"""``infer-worker verify``: options, configuration, exit status."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from worker.config import KafkaConfig, load_settings
from worker.flow.errors import ConfigError
from worker.kafka.clients import read_isolation
from worker.kafka.credentials import connection
from worker.kafka.diagnose import run_tool
from worker.kafka.registry_results import RegistryResults
from worker.ops.verify.check import check
from worker.ops.verify.read import read_topics


def _topic_list(text: str) -> list[str]:
    return list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``verify`` command's options. Kafka settings left out come from
    ``--config`` (file plus ``INFER_WORKER_*`` overrides, exactly as ``run``
    reads them, so the verifier checks the topics that worker uses) or else
    from the built-in defaults."""
    parser.add_argument(
        "--config", help="TOML file to take bootstrap servers and topics from (flags win)"
    )
    parser.add_argument("--bootstrap-servers", help="host:port[,host:port...]")
    parser.add_argument("--input-topics", help="comma-separated request topics")
    parser.add_argument("--output-topic", help="result topic")
    parser.add_argument("--dlq-topic", help="dead-letter topic")
    parser.add_argument(
        "--strict", action="store_true", help="duplicates fail the check too (exactly-once)"
    )
    add_reading_arguments(parser)


def emit(text: str, doc: dict[str, Any], json_path: str | None) -> None:
    """The report as text on stdout, and as JSON to ``--json`` (``-``: stdout
    instead of the text)."""
    if json_path == "-":
        print(json.dumps(doc, indent=2))
        return
    print(text)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")


def results_registry(args: argparse.Namespace) -> RegistryResults | None:
    """What reads results in a Schema Registry format: ``--schema-registry``, else
    the configuration's ``schema_registry``; None without either."""
    cfg = load_settings(args.config).schema_registry
    if args.schema_registry:
        cfg = dataclasses.replace(cfg, url=args.schema_registry)
    return RegistryResults(cfg) if cfg.enabled else None


def add_reading_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``verify`` and ``compare`` read topics with, and where they report."""
    parser.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON ('-': stdout)"
    )
    parser.add_argument(
        "--schema-registry", metavar="URL",
        help="read results in a Schema Registry format (Avro, JSON Schema, Protobuf) with "
        "this registry (default: the config's schema_registry.url)",
    )
    parser.add_argument(
        "--read-committed",
        action="store_true",
        help="read only committed transactions (workers running exactly-once; "
        'implied when --config sets kafka.processing_guarantee = "exactly-once")',
    )
    parser.add_argument(
        "--idle-timeout", type=float, default=2.0, metavar="SECONDS",
        help="stop reading once no record arrived for this long (default 2)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=60.0, metavar="SECONDS",
        help="give up if the topics are not quiet after this long (default 60)",
    )  # fmt: skip


def _kafka_config(args: argparse.Namespace) -> KafkaConfig:
    """Flags over ``--config`` and ``INFER_WORKER_KAFKA__*`` over defaults,
    validated by ``KafkaConfig`` itself so the verifier rejects exactly the topic
    layouts the worker rejects; the security settings are the worker's."""
    base = load_settings(args.config).kafka  # INFER_WORKER_KAFKA__* too: security, topics
    changes: dict[str, Any] = {}
    if args.bootstrap_servers is not None:
        changes["bootstrap_servers"] = args.bootstrap_servers
    if args.input_topics is not None:
        changes["input_topics"] = tuple(_topic_list(args.input_topics))
    if args.output_topic is not None:
        changes["output_topic"] = args.output_topic
    if args.dlq_topic is not None:
        changes["dlq_topic"] = args.dlq_topic
    kafka = dataclasses.replace(base, **changes)
    if not (args.idle_timeout > 0 and args.timeout > 0):
        raise ConfigError("--idle-timeout and --timeout must be > 0")
    return kafka


def run(args: argparse.Namespace) -> int:
    """Read, verify, print. Exit status: 0 ok; 1 something lost (or duplicated
    with ``--strict``), or the topics never went quiet within ``--timeout``;
    2 usage or configuration errors, including topics that do not exist and
    a broker that cannot be reached (the check could not be made)."""
    try:
        kafka = _kafka_config(args)
    except ConfigError as exc:
        print(f"infer-worker verify: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        inputs, observed = run_tool(
            kafka,
            read_topics(
                connection(kafka),
                kafka.input_topics,
                kafka.output_topic,
                kafka.dlq_topic,
                idle_timeout=args.idle_timeout,
                timeout=args.timeout,
                isolation_level=read_isolation(kafka, args.read_committed),
                registry=results_registry(args),
            ),
        )
    except ConfigError as exc:  # Kafka refused or missed the settings (``run_tool``), or a
        # topic cannot be read (``TopicUnreadable``)
        print(f"infer-worker verify: configuration error: {exc}", file=sys.stderr)
        return 2
    report = check(inputs, observed.answers, unparseable=observed.unparseable, strict=args.strict)
    doc = {
        **report.to_dict(),
        "complete": observed.complete,
        "topics": {
            "bootstrap_servers": kafka.bootstrap_servers,
            "input": list(kafka.input_topics),
            "output": kafka.output_topic,
            "dlq": kafka.dlq_topic,
        },
    }
    emit(report.format(), doc, args.json)
    if not observed.complete:
        print(
            f"infer-worker verify: topics still busy after {args.timeout}s; "
            "the report covers only what was read",
            file=sys.stderr,
        )
        return 1
    return 0 if report.ok else 1
