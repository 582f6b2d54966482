"""``[schema_registry]``: requests and results in a Schema Registry's wire format
(docs/guides/schema-registry.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from worker.config.checks import check, derive
from worker.config.secret import Secret

_AVRO_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class SchemaRegistryConfig:
    """A Confluent-compatible Schema Registry (Confluent's, or Apicurio's ccompat API).
    With ``url`` set, a record whose value starts with the registry's magic byte (0)
    and a schema id is read with that schema (Avro, JSON Schema, Protobuf), answered in
    its format with the worker's result schema, registered at start-up; msgpack and
    Open Inference Protocol JSON records keep working on the same topics."""

    # The registry's base URL, e.g. "http://registry:8081" or Apicurio's
    # "http://registry:8080/apis/ccompat/v7"; "" = off (a record in the registry's format
    # then goes to the DLQ).
    url: str = ""
    # HTTP basic auth to the registry: the user ("" = none).
    username: str = ""
    # HTTP basic auth: the password. A Secret: never printed or logged.
    password: Secret | None = None
    # TLS: the certificate authority (PEM) that signed the registry's certificate; "" = the
    # system's.
    ca_file: str = ""
    # The registry formats read and answered in: "avro", "jsonschema", "protobuf" (a record of
    # another format goes to the DLQ saying so). A result schema is registered for each:
    # the first under the subject below, each other under SUBJECT-FORMAT.
    formats: tuple[str, ...] = ("avro",)
    # The subject the result schema is registered under: "topic" (OUTPUT_TOPIC-value),
    # "record" (NAMESPACE.NAME) or "topic_record" (OUTPUT_TOPIC-NAMESPACE.NAME).
    subject_strategy: Literal["topic", "record", "topic_record"] = "topic"
    # The result schema's record name.
    result_name: str = "InferenceResult"
    # The result schema's namespace.
    result_namespace: str = "infer_worker"
    # One HTTP call to the registry may take this long.
    request_timeout_ms: int = 5000
    # A record whose schema id the worker has not seen waits this long, the registry asked
    # again with backoff, while the registry cannot be reached; then it goes to the DLQ
    # naming the id (nothing is lost). A schema the registry says it does not have goes to
    # the DLQ at once.
    lookup_timeout_ms: int = 60_000

    def __post_init__(self) -> None:
        value: object = self.password
        if isinstance(value, str):  # given in code: typed here, once
            derive(self, "password", Secret(value))
        url = self.url
        check(not url or url.startswith(("http://", "https://")), "schema_registry.url",
              f"{url[:80]!r}: an http:// or https:// URL")  # fmt: skip
        check(self.password is None or bool(self.username), "schema_registry.password",
              "needs schema_registry.username")  # fmt: skip
        for key in ("result_name", "result_namespace"):
            parts = getattr(self, key).split(".")
            check(all(_AVRO_NAME.fullmatch(p) for p in parts), f"schema_registry.{key}",
                  f"{getattr(self, key)!r}: an Avro name (letters, digits, _; "
                  "dotted for a namespace)")  # fmt: skip
        known = ("avro", "jsonschema", "protobuf")
        odd = [f for f in self.formats if f not in known]
        check(not odd and bool(self.formats) and len(set(self.formats)) == len(self.formats),
              "schema_registry.formats", f"{list(self.formats)}: one or more of {list(known)}, "
              "each once")  # fmt: skip
        check(self.request_timeout_ms > 0, "schema_registry.request_timeout_ms", "must be > 0")
        check(self.lookup_timeout_ms >= 0, "schema_registry.lookup_timeout_ms", "must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    def subject(self, topic: str, fmt: str = "") -> str:
        """The subject of ``topic``'s result schema in ``fmt`` (``subject_strategy``;
        a format after the first: its name appended)."""
        full = f"{self.result_namespace}.{self.result_name}"
        if self.subject_strategy == "record":
            subject = full
        elif self.subject_strategy == "topic_record":
            subject = f"{topic}-{full}"
        else:
            subject = f"{topic}-value"
        return subject if not fmt or fmt == self.formats[0] else f"{subject}-{fmt}"
