"""``infer-worker produce`` and ``consume``: a client's view of the topics."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from worker.cli.common import Subparsers, add_command, client_settings, kafka_flags
from worker.config import SchemaRegistryConfig, Settings


def produce_command(args: argparse.Namespace) -> int:
    from worker.ops.produce import run_produce
    from worker.ops.requests import parse_meta

    s = client_settings(args)
    input_name, named = _inputs(args.input)
    # The configuration as the worker reads it: --topic picks where to send,
    # without rewriting kafka.input_topics (a lanes configuration names them all).
    return run_produce(
        s.kafka, s.limits, args.files, args.samples, not args.no_wait, args.timeout, args.json,
        topic=args.topic, texts=args.text, input_name=input_name, sample_model=args.model,
        oip=args.oip, meta=parse_meta(args.meta), count=args.count, rate=args.rate,
        model_name=args.model_name, model_version=args.model_version, named=named,
        allow_errors=args.allow_errors, registry=_registry(args, s),
        registry_format=args.schema_format,
    )  # fmt: skip


def _registry(args: argparse.Namespace, s: Settings) -> SchemaRegistryConfig | None:
    """``--schema-registry``: the requests in its format (``--schema-format``)."""
    if not args.schema_registry:
        return None
    return dataclasses.replace(s.schema_registry, url=args.schema_registry)


def _inputs(given: list[str]) -> tuple[str | None, dict[str, Path]]:
    """``--input``: NAME (what files and texts are sent as) or NAME=FILE (one
    input of a request of several), each named once."""
    from worker.flow.errors import ConfigError

    plain = [g for g in given if "=" not in g]
    if len(plain) > 1:
        raise ConfigError(f"--input: {plain}: name the input files and texts go to once")
    named: dict[str, Path] = {}
    for g in given:
        name, eq, path = g.partition("=")
        if not eq:
            continue
        if not name or not path or name in named:
            raise ConfigError(f"--input {g!r}: expected NAME=FILE, each NAME once")
        named[name] = Path(path)
    return (plain[0] if plain else None), named


def consume_command(args: argparse.Namespace) -> int:
    from worker.ops.produce import run_consume
    from worker.ops.verify.cli import results_registry

    return run_consume(client_settings(args).kafka, args.id, args.timeout, args.json,
                       results_registry(args))  # fmt: skip


def add_client(sub: Subparsers[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "produce", "send images or texts as requests and print their answers",
        "Send image files (JPEG, PNG or WebP as they are; .npy arrays as tensors), texts "
        "(--text) or a bundled model's samples to the input topic, each with a unique id, "
        "then wait for their answers and print them (top classes, the outputs, or the "
        "error). Exit 0 every answer ok; 1 an answer did not come within --timeout or was an "
        "error (--allow-errors: only the first); 2 usage or configuration errors.",
        produce_command,
        epilog="examples:\n  infer-worker produce --samples 3\n  infer-worker produce a.png b.jpg\n"
        '  infer-worker produce --text "The battery was great"\n'
        "  infer-worker produce --samples 3 --model sentiment\n"
        "  infer-worker produce cat.jpg --meta label=281\n"
        "  infer-worker produce --input features=x.npy --input ids=ids.npy\n"
        "  infer-worker produce --samples 360 --count 50000 --no-wait   # a backlog\n"
        "  infer-worker produce --samples 360 --count 6000 --rate 100   # a steady stream",
    )  # fmt: skip
    p.add_argument("files", nargs="*", metavar="IMAGE", help="image files or .npy arrays")
    p.add_argument(
        "--text", action="append", default=[], help="send this text (repeatable)"
    )  # fmt: skip
    p.add_argument(
        "--input", action="append", default=[], metavar="NAME[=FILE]",
        help="NAME: the request input files and texts are sent as (default: image for "
        "files, text for texts); NAME=FILE (repeatable): one request of several inputs, "
        "each a .npy array or an image file, as a model of several inputs takes them",
    )  # fmt: skip
    p.add_argument(
        "--samples", type=int, default=0,
        help="also send N bundled samples (past the held-out set they cycle, each copy "
        "a request with its own id)",
    )  # fmt: skip
    p.add_argument(
        "--count", type=int, default=None, metavar="N",
        help="send N requests in all: what is given (files, texts, samples), cycled, each "
        "copy with its own id; a backlog with --no-wait",
    )  # fmt: skip
    p.add_argument(
        "--rate", type=float, default=0.0, metavar="R",
        help="at most R requests a second, evenly spaced (default: as fast as the broker "
        "acknowledges)",
    )  # fmt: skip
    p.add_argument(
        "--oip", action="store_true",
        help="send Open Inference Protocol v2 JSON (content-type: application/json), not msgpack",
    )  # fmt: skip
    p.add_argument(
        "--model", choices=("digits", "sentiment"), default="digits",
        help="whose samples --samples sends (default digits)",
    )  # fmt: skip
    p.add_argument(
        "--meta", action="append", default=[], metavar="KEY=VALUE",
        help="add to every request's meta (repeatable; JSON values as such: label=7 is "
        "the number 7); samples carry their true class as meta.label already",
    )  # fmt: skip
    p.add_argument(
        "--model-name", default=None, metavar="NAME",
        help="the model to answer them, where the worker serves several (each request "
        "names it; docs/guides/models.md)",
    )  # fmt: skip
    p.add_argument(
        "--model-version", default=None, metavar="VERSION",
        help="with --model-name: the version that must answer (else unknown_model)",
    )  # fmt: skip
    p.add_argument("--topic", help="input topic (default: the config's first input topic)")
    p.add_argument("--no-wait", action="store_true", help="send only; do not wait for answers")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    p.add_argument("--json", action="store_true", help="print each result as one JSON line")
    p.add_argument(
        "--schema-registry", metavar="URL",
        help="send the requests in a Schema Registry format (--schema-format), their schema "
        "made from the first request's inputs and registered under TOPIC-value; the "
        "answers read with the registry",
    )  # fmt: skip
    p.add_argument(
        "--schema-format", choices=("avro", "jsonschema", "protobuf"), default="avro",
        help="with --schema-registry: the format (default avro)",
    )  # fmt: skip
    p.add_argument(
        "--allow-errors", action="store_true",
        help="exit 0 though some answers are errors (default: exit 1, as for a request "
        "left unanswered)",
    )  # fmt: skip
    kafka_flags(p)
    c = add_command(
        sub, "consume", "print results as they arrive",
        "Print the results on the output topic (from its beginning; no consumer group "
        "is joined, nothing is committed) and the DLQ's records, until --timeout or Ctrl-C. "
        "With --id, only those results, and exit once all have arrived (1 if some did not).",
        consume_command,
        epilog="examples:\n  infer-worker consume --timeout 10\n"
        "  infer-worker consume --id sample-0-1a2b3c4d --timeout 30",
    )  # fmt: skip
    c.add_argument("--id", action="append", default=[], help="wait for this request id")
    c.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    c.add_argument("--json", action="store_true", help="print each result as one JSON line")
    c.add_argument(
        "--schema-registry", metavar="URL",
        help="read results in a Schema Registry format (Avro, JSON Schema, Protobuf) with "
        "this registry (default: the config's schema_registry.url)",
    )  # fmt: skip
    kafka_flags(c)
