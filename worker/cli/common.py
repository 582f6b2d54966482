"""What the command modules share: adding a subcommand, Kafka flags, --set pairs."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from worker.config import Settings, load_settings
from worker.flow.errors import ConfigError

Subparsers = argparse._SubParsersAction  # the type argparse hands out, not public


def add_command(
    sub: Subparsers[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
    func: Callable[[argparse.Namespace], int],
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """A subcommand whose --help keeps the description's and epilog's line breaks."""
    parser = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=func)
    return parser


def kafka_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file to take Kafka settings and topics from")
    parser.add_argument(
        "--bootstrap-servers", help="host:port (default: the config's, else localhost:9092)"
    )


def client_settings(args: argparse.Namespace) -> Settings:
    """The settings of --config, with --bootstrap-servers over the config's."""
    settings = load_settings(args.config)
    if getattr(args, "bootstrap_servers", None):
        kafka = dataclasses.replace(settings.kafka, bootstrap_servers=args.bootstrap_servers)
        settings = dataclasses.replace(settings, kafka=kafka)
    return settings


def parse_sets(items: list[str]) -> dict[str, str]:
    """``--set section.key=value`` pairs, as the setting overrides tools pass on."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out[key.strip()] = value.strip()
    return out


def number_list(kind: Callable[[str], float]) -> Callable[[str], list[Any]]:
    """An argparse type for comma-separated numbers (``--rates 200,1000``)."""

    def parse(text: str) -> list[Any]:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {exc}") from exc

    return parse
