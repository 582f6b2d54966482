"""Client arguments: pass-through options (refused where the worker sets the
argument itself or aiokafka lacks it) and OAUTHBEARER's token provider."""

from __future__ import annotations

import pytest
from aiokafka.abc import AbstractTokenProvider

from worker.config import load_settings
from worker.flow.errors import ConfigError
from worker.kafka.clients import (
    client_kwargs,
    exactly_once,
    group_consumer_kwargs,
    producer_kwargs,
    transactional_id,
)


class StaticToken(AbstractTokenProvider):
    async def token(self) -> str:
        return "header.payload.signature"


def make_provider() -> StaticToken:
    return StaticToken()


def not_a_provider() -> object:
    return object()


def kafka(**env: str):  # type: ignore[no-untyped-def]
    return load_settings(env={f"INFER_WORKER_KAFKA__{k.upper()}": v for k, v in env.items()}).kafka


def test_options_pass_through_with_their_toml_types() -> None:
    k = kafka(
        consumer_options__isolation_level="read_committed",
        consumer_options__connections_max_idle_ms="60000",
        producer_options__enable_idempotence="true",
    )
    consumer = group_consumer_kwargs(k)
    assert consumer["isolation_level"] == "read_committed"
    assert consumer["connections_max_idle_ms"] == 60000
    assert consumer["enable_auto_commit"] is False  # the worker's own stay
    producer = producer_kwargs(k)
    assert producer["enable_idempotence"] is True and producer["acks"] == "all"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"consumer_options__enable_auto_commit": "true"}, "consumer_options.enable_auto_commit"),
        ({"consumer_options__group_id": "other"}, "consumer_options.group_id: set by the worker"),
        ({"producer_options__acks": "1"}, "producer_options.acks: set by the worker"),
        ({"producer_options__value_serializer": "x"}, "producer_options.value_serializer"),
        ({"consumer_options__isolation_levle": "x"}, "not an argument of aiokafka's AIOKafkaC"),
        ({"producer_options__isolation_level": "x"}, "not an argument of aiokafka's AIOKafkaP"),
    ],
)
def test_options_the_worker_owns_or_aiokafka_lacks_are_refused(
    env: dict[str, str], message: str
) -> None:
    k = kafka(**env)
    with pytest.raises(ConfigError, match=message):
        group_consumer_kwargs(k)
        producer_kwargs(k)


def test_oauthbearer_calls_the_named_factory() -> None:
    k = kafka(
        security_protocol="SASL_SSL",
        sasl_mechanism="OAUTHBEARER",
        sasl_oauth_token_provider=f"{__name__}:make_provider",
    )
    kwargs = client_kwargs(k)
    assert isinstance(kwargs["sasl_oauth_token_provider"], StaticToken)
    assert kwargs["sasl_mechanism"] == "OAUTHBEARER" and "sasl_plain_username" not in kwargs


def test_oauthbearer_needs_a_provider_that_is_one() -> None:
    with pytest.raises(ConfigError, match=r"kafka\.sasl_oauth_token_provider"):
        kafka(security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER")
    for spec, message in [
        ("no_such_module_xyz:f", "cannot import"),
        (f"{__name__}:missing", "cannot import"),
        (f"{__name__}:not_a_provider", "returned object, not an aiokafka"),
    ]:
        k = kafka(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="OAUTHBEARER",
            sasl_oauth_token_provider=spec,
        )
        with pytest.raises(ConfigError, match=message):
            client_kwargs(k)


def test_exactly_once_needs_a_stable_transactional_id_and_reads_committed() -> None:
    default = kafka()
    assert default.processing_guarantee == "at-least-once" and not exactly_once(default)
    assert "isolation_level" not in group_consumer_kwargs(default)
    with pytest.raises(ConfigError, match="group_instance_id"):
        kafka(processing_guarantee="exactly-once")  # a random member id fences nothing
    static = kafka(processing_guarantee="exactly-once", group_instance_id="pod-0")
    assert transactional_id(static) == "infer-worker.pod-0"
    assert group_consumer_kwargs(static)["isolation_level"] == "read_committed"
    named = kafka(processing_guarantee="exactly-once", transactional_id="t-7")
    assert transactional_id(named) == "t-7"
    with pytest.raises(ConfigError, match="enable_idempotence"):
        kafka(
            processing_guarantee="exactly-once", group_instance_id="p", enable_idempotence="false"
        )
    with pytest.raises(ConfigError, match="processing_guarantee"):
        kafka(processing_guarantee="exactly_once")
    with pytest.raises(ConfigError, match="transaction_timeout_ms"):
        producer_kwargs(kafka(producer_options__transaction_timeout_ms="1000"))
