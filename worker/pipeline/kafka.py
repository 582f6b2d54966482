"""Connection settings shared by the consumer and the producer."""

from __future__ import annotations

from typing import Any

from worker.config import KafkaConfig


def group_consumer_kwargs(k: KafkaConfig) -> dict[str, Any]:
    """aiokafka consumer arguments for a worker in the group: manual commits only,
    and a new group starts at the earliest offset (for a work queue, "latest"
    would skip requests produced before the group first joined)."""
    return {
        "group_id": k.group_id,
        "group_instance_id": k.group_instance_id or None,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": k.session_timeout_ms,
        "heartbeat_interval_ms": k.heartbeat_interval_ms,
        "max_poll_interval_ms": k.max_poll_interval_ms,
        "max_poll_records": k.max_poll_records,
        "fetch_max_bytes": k.fetch_max_bytes,
        "fetch_max_wait_ms": k.fetch_max_wait_ms,
        "max_partition_fetch_bytes": k.max_partition_fetch_bytes,
        **client_kwargs(k),
    }


def client_kwargs(k: KafkaConfig) -> dict[str, Any]:
    """aiokafka keyword arguments for bootstrap, identity and security."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": k.bootstrap_servers,
        "client_id": k.client_id,
        "security_protocol": k.security_protocol,
        "metadata_max_age_ms": k.metadata_max_age_ms,
        "request_timeout_ms": k.request_timeout_ms,
    }
    if k.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        kwargs["ssl_context"] = create_ssl_context(
            cafile=k.ssl_cafile, certfile=k.ssl_certfile, keyfile=k.ssl_keyfile
        )
    if k.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = k.sasl_mechanism
        kwargs["sasl_plain_username"] = k.sasl_plain_username
        kwargs["sasl_plain_password"] = k.sasl_plain_password
    return kwargs
