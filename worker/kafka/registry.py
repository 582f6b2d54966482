"""The Schema Registry (``[schema_registry]``): its HTTP API, the request schemas
by id, and the result schema registered at start-up.

Confluent's REST API, which Apicurio Registry also serves (``/apis/ccompat/v7``):
``GET /schemas/ids/{id}`` and ``POST /subjects/{subject}/versions``. Calls run
on a thread (the standard library's HTTP client: two calls, no dependency),
with basic auth and TLS as configured; the password is never logged.

Request schemas are fetched once per id, before the record is made a job
(``Schemas.ready``, awaited by the consumer), so the intake reads them from
memory. A schema the registry does not have is an answer at once: the record
goes to the DLQ naming the id. A registry that cannot be reached is asked again
with backoff for ``lookup_timeout_ms``, the partition's records waiting (the
ones already known keep flowing where no unknown id comes before them); then the
record goes to the DLQ with the reason, and the next record with that id asks
again. Nothing is lost either way.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping
from typing import Any, Final
from urllib.parse import quote

import structlog

from worker.config import SchemaRegistryConfig
from worker.contract.registered import FORMATS, Format, RequestSchema, schema_id
from worker.flow.backoff import Backoff
from worker.flow.errors import UndecodableRecord

log = structlog.get_logger(__name__)

CONTENT_TYPE: Final = "application/vnd.schemaregistry.v1+json"


class NotFound(Exception):
    """The registry answered: it has no such schema."""


class Unreachable(Exception):
    """No answer from the registry that serves the call (connection, timeout, a
    refusal: 401, 403, 409, a 5xx)."""


class SchemaRegistry:
    """Blocking calls to the registry: run them on a thread."""

    def __init__(self, cfg: SchemaRegistryConfig) -> None:
        self._base = cfg.url.rstrip("/")
        self._timeout = cfg.request_timeout_ms / 1000.0
        self._headers = {"Accept": CONTENT_TYPE, "Content-Type": CONTENT_TYPE}
        if cfg.username:
            secret = cfg.password.reveal() if cfg.password is not None else ""
            token = base64.b64encode(f"{cfg.username}:{secret}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"
        self._tls = (
            ssl.create_default_context(cafile=cfg.ca_file or None)
            if self._base.startswith("https://")
            else None
        )

    def schema(self, sid: int, serialized: bool = False) -> tuple[str, str]:
        """Schema ``sid``'s type (AVRO, PROTOBUF, JSON) and text; ``serialized``: a
        Protobuf schema as a base64 FileDescriptorProto (Confluent's format=serialized)."""
        body = self._call("GET", f"/schemas/ids/{sid}" + ("?format=serialized" if serialized
                                                             else ""))  # fmt: skip
        return str(body.get("schemaType") or "AVRO"), str(body["schema"])

    def register(self, subject: str, schema: Mapping[str, Any] | str, kind: str = "AVRO") -> int:
        """Register a schema of ``kind`` (AVRO, JSON: its JSON; PROTOBUF: its text)
        under ``subject`` (the id it already has, if any)."""
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        payload = {"schema": text, "schemaType": kind}
        body = self._call("POST", f"/subjects/{quote(subject, safe='')}/versions", payload)
        return int(body["id"])

    def _call(self, method: str, path: str, payload: object | None = None) -> dict[str, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self._base + path, data=data, method=method,
                                     headers=self._headers)  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._tls) as resp:
                body = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            text = exc.read()[:300].decode("utf-8", "replace")
            if exc.code == 404:
                raise NotFound(f"{method} {path}: 404 {text}") from exc
            # Refused (401, 403, 409, ...) or failing: the caller decides what it means.
            raise Unreachable(f"{method} {path}: {exc.code} {text}") from exc
        except (OSError, ValueError) as exc:  # refused, reset, timed out, not JSON
            raise Unreachable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(body, dict):
            raise Unreachable(f"{method} {path}: the answer is not a JSON object")
        return body


AVRO_ONLY: tuple[Format, ...] = ("avro",)


class Schemas:
    """Request schemas by id: fetched once (``ready``), read by the intake (``get``)."""

    def __init__(
        self, registry: SchemaRegistry, lookup_timeout_s: float,
        formats: Collection[Format] = AVRO_ONLY,
    ) -> None:  # fmt: skip
        """``formats``: the ones answered in (a result schema registered for each)."""
        self._registry = registry
        self._lookup_timeout_s = lookup_timeout_s
        self._formats = frozenset(formats)
        self._known: dict[int, RequestSchema] = {}
        self._refused: dict[int, str] = {}  # ids the registry answered for: why not
        self._failed: dict[int, str] = {}  # ids not reached this time: why (asked again)

    def unseen(self, value: bytes | None) -> bool:
        """Whether ``value`` names a schema id not looked up yet (cheap: no
        coroutine per record for the common case)."""
        if not value or value[:1] != b"\x00":
            return False
        sid = schema_id(value)
        return sid is not None and sid not in self._known and sid not in self._refused

    async def ready(self, value: bytes | None) -> None:
        """Before ``value`` is made a job: its schema fetched if it names one not
        seen yet (returns at once for every other record)."""
        sid = schema_id(value) if value else None
        if sid is None or sid in self._known or sid in self._refused:
            return
        self._failed.pop(sid, None)
        await self._fetch(sid)

    def get(self, sid: int) -> RequestSchema:
        """The schema of a record ``ready`` has seen; ``UndecodableRecord`` (the
        DLQ, with the reason) when there is none."""
        found = self._known.get(sid)
        if found is not None:
            return found
        reason = self._refused.get(sid) or self._failed.pop(sid, None)
        raise UndecodableRecord(reason or f"schema id {sid}: not looked up")

    async def _fetch(self, sid: int) -> None:
        backoff = Backoff(0.1, cap=5.0)
        started = time.monotonic()
        while True:
            try:
                kind, text = await asyncio.to_thread(self._registry.schema, sid)
                break
            except NotFound:
                self._refused[sid] = f"schema id {sid} is not in the schema registry"
                return
            except Unreachable as exc:
                left = self._lookup_timeout_s - (time.monotonic() - started)
                if left <= 0:
                    self._failed[sid] = (f"schema id {sid}: the schema registry did not answer "
                                         f"for {self._lookup_timeout_s:.0f}s ({exc})")  # fmt: skip
                    log.error("schema_registry_unreachable", schema_id=sid, error=str(exc))
                    return
                log.warning("schema_registry_retry", schema_id=sid, error=str(exc))
                # Never past the lookup time: the last try comes as it ends.
                await asyncio.sleep(min(backoff.next(), left))
        fmt = FORMATS.get(kind)
        if fmt is None or fmt not in self._formats:
            self._refused[sid] = (f"schema id {sid} is {kind}: the worker reads "
                                  f"{sorted(self._formats)} (schema_registry.formats)")  # fmt: skip
            return
        try:
            self._known[sid] = await asyncio.to_thread(request_schema, sid, fmt, text,
                                                       self._registry)  # fmt: skip
        except Unreachable as exc:
            self._failed[sid] = f"schema id {sid}: {exc}"
            return
        except ValueError as exc:
            self._refused[sid] = str(exc)
            return
        log.info("schema_registered_seen", schema_id=sid, format=fmt)



def request_schema(sid: int, fmt: Format, text: str, registry: SchemaRegistry) -> RequestSchema:
    """Schema ``sid`` (``text``, as the registry served it) read as a request schema
    of ``fmt``; ``ValueError`` naming what is wrong with it. Blocking: a Protobuf
    ``.proto`` text is asked for again serialized (Confluent's registry does)."""
    # The formats' modules (and their libraries) load with the first schema of one.
    from worker.contract.avro import WriterSchema
    from worker.contract.json_schema import JsonRequestSchema
    from worker.contract.protobuf import ProtobufRequestSchema

    if fmt == "avro":
        return WriterSchema.of(sid, text)
    if fmt == "jsonschema":
        return JsonRequestSchema.of(sid, text)
    try:
        return ProtobufRequestSchema.of(sid, text)
    except ValueError:
        return ProtobufRequestSchema.of(sid, registry.schema(sid, serialized=True)[1])
