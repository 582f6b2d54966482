"""The Schema Registry at start-up (``[schema_registry]``): a result schema made
from every answerer's outputs for each format answered in
(``schema_registry.formats``) and registered under the output topic's subject,
before Kafka is contacted; a registry that cannot be reached, or refuses a
schema, stops start-up with exit 2 naming the setting."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import structlog

from worker.config import Settings
from worker.contract.registered import Format, OutputDesc, ResultEncoder
from worker.flow.errors import ConfigError, UndecodableRecord
from worker.kafka.registry import NotFound, SchemaRegistry, Schemas, Unreachable

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Registered:
    """What the intake reads request schemas from, and the writer encodes with
    (by format)."""

    schemas: Schemas
    results: Mapping[Format, ResultEncoder]


async def registered(s: Settings, outputs: Mapping[str, OutputDesc]) -> Registered | None:
    """``outputs``: every output any answerer may answer with (by name)."""
    cfg = s.schema_registry
    if not cfg.enabled:
        return None
    registry = SchemaRegistry(cfg)
    results: dict[Format, ResultEncoder] = {}
    for fmt in cast(tuple[Format, ...], cfg.formats):
        try:
            schema = _schema(fmt, cfg.result_name, cfg.result_namespace, outputs)
        except ValueError as exc:
            raise ConfigError(f"schema_registry: the {fmt} result schema: {exc}") from exc
        subject = cfg.subject(s.kafka.output_topic, fmt)
        try:
            sid = await asyncio.to_thread(registry.register, subject, _text(schema), _KINDS[fmt])
            results[fmt] = _encoder(fmt, schema, sid)
        except (Unreachable, NotFound) as exc:
            raise ConfigError(f"schema_registry.url: registering the {fmt} result schema under "
                              f"{subject!r} failed: {exc}") from exc  # fmt: skip
        except UndecodableRecord as exc:  # the codec's library missing
            raise ConfigError(f"schema_registry.formats: {exc}") from exc
        log.info("result_schema_registered", format=fmt, subject=subject, schema_id=sid,
                 outputs=sorted(outputs))  # fmt: skip
    schemas = Schemas(registry, cfg.lookup_timeout_ms / 1000.0, tuple(results))
    return Registered(schemas, results)


_KINDS: dict[Format, str] = {"avro": "AVRO", "jsonschema": "JSON", "protobuf": "PROTOBUF"}


def _schema(fmt: Format, name: str, namespace: str, outputs: Mapping[str, OutputDesc]) -> Any:
    # The formats' modules (and their libraries) load only where one is configured.
    from worker.contract import avro, json_schema, protobuf

    if fmt == "avro":
        return avro.result_schema(name, namespace, outputs)
    if fmt == "jsonschema":
        return json_schema.result_schema(name, namespace, outputs)
    return protobuf.result_schema(name, namespace, outputs)


def _text(schema: Any) -> Any:
    """What is registered: Avro's and JSON Schema's JSON, Protobuf's serialized file."""
    from worker.contract import protobuf

    return protobuf.serialized(schema) if not isinstance(schema, dict) else schema


def _encoder(fmt: Format, schema: Any, sid: int) -> ResultEncoder:
    from worker.contract import avro, json_schema, protobuf

    if fmt == "avro":
        return avro.AvroResults(schema, sid)
    if fmt == "jsonschema":
        return json_schema.JsonResults(schema, sid)
    return protobuf.ProtobufResults(schema, sid)
