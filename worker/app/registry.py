"""The Schema Registry at start-up (``[schema_registry]``): the result schema made
from every answerer's outputs and registered under the output topic's subject,
before Kafka is contacted; a registry that cannot be reached, or refuses the
schema, stops start-up with exit 2 naming the setting."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from worker.config import Settings
from worker.contract.avro import AvroResults, result_schema
from worker.contract.registered import OutputDesc
from worker.flow.errors import ConfigError, UndecodableRecord
from worker.kafka.registry import NotFound, SchemaRegistry, Schemas, Unreachable

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Registered:
    """What the intake reads request schemas from, and the writer encodes with."""

    schemas: Schemas
    results: AvroResults


async def registered(s: Settings, outputs: Mapping[str, OutputDesc]) -> Registered | None:
    """``outputs``: every output any answerer may answer with (by name)."""
    cfg = s.schema_registry
    if not cfg.enabled:
        return None
    try:
        schema = result_schema(cfg.result_name, cfg.result_namespace, outputs)
    except ValueError as exc:
        raise ConfigError(f"schema_registry: the result schema: {exc}") from exc
    subject = cfg.subject(s.kafka.output_topic)
    registry = SchemaRegistry(cfg)
    try:
        sid = await asyncio.to_thread(registry.register, subject, schema)
        results = AvroResults(schema, sid)
    except (Unreachable, NotFound) as exc:
        raise ConfigError(f"schema_registry.url: registering the result schema under "
                          f"{subject!r} failed: {exc}") from exc  # fmt: skip
    except UndecodableRecord as exc:  # fastavro missing
        raise ConfigError(f"schema_registry.url: {exc}") from exc
    log.info("result_schema_registered", subject=subject, schema_id=sid,
             outputs=sorted(outputs))  # fmt: skip
    return Registered(Schemas(registry, cfg.lookup_timeout_ms / 1000.0), results)
