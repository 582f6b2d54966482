"""Connection settings shared by the consumer and the producer."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Literal, TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import BrokerResponseError

from worker.config import KafkaConfig
from worker.flow.errors import ConfigError
from worker.kafka.credentials import connection
from worker.kafka.permissions import refused

log = structlog.get_logger(__name__)

# Never passed through: (de)serialisers would change what the worker reads and
# writes, auto-commit and transactions would break "commit after the ack".
_NEVER = frozenset({
    "loop", "key_serializer", "value_serializer", "key_deserializer", "value_deserializer",
    "enable_auto_commit", "auto_commit_interval_ms", "transactional_id",
    "transaction_timeout_ms",
})  # fmt: skip


def group_consumer_kwargs(k: KafkaConfig) -> dict[str, Any]:
    """aiokafka consumer arguments for a worker in the group: manual commits only,
    and a new group starts at the earliest offset (for a work queue, "latest"
    would skip requests produced before the group first joined)."""
    managed = {
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
    if exactly_once(k) and "isolation_level" not in k.consumer_options:
        # Requests written by transactional producers upstream are answered only
        # once committed, as Kafka Streams does under exactly-once.
        managed["isolation_level"] = "read_committed"
    return with_options(managed, k.consumer_options, AIOKafkaConsumer, "consumer_options")


def exactly_once(k: KafkaConfig) -> bool:
    return k.exactly_once


def read_isolation(k: KafkaConfig, read_committed: bool = False) -> str:
    """How a tool reads the worker's topics: committed transactions only where
    asked or where the worker writes in transactions (exactly-once), whose
    aborted results a reader must not count."""
    return "read_committed" if read_committed or k.exactly_once else "read_uncommitted"


def transactional_id(k: KafkaConfig) -> str:
    """This member's transactional id: as configured, or the group id and the
    static member id, both stable across the member's restarts (so a restarted
    member's InitProducerId fences the process it replaces)."""
    return k.member_transactional_id


def producer_kwargs(k: KafkaConfig, idempotent: bool | None = None) -> dict[str, Any]:
    """aiokafka producer arguments for results and DLQ records: acknowledged by
    every in-sync replica, since offsets are committed on that acknowledgement;
    idempotent or not as ``idempotent`` says (see ``start_producer``)."""
    mode = idempotence(k)  # checked here too: start-up refuses a contradiction
    managed: dict[str, Any] = {
        "acks": "all",
        "max_request_size": k.max_request_size,
        "compression_type": None if k.compression_type == "none" else k.compression_type,
        "linger_ms": k.linger_ms,
        "retry_backoff_ms": k.retry_backoff_ms,
        # One record batch per output partition per completed batch: room for a
        # full batch of results (the producer's default is 16 KiB).
        "max_batch_size": min(k.max_request_size, 1 << 20),
        **client_kwargs(k),
    }
    if idempotent is not None and "enable_idempotence" not in k.producer_options:
        managed["enable_idempotence"] = idempotent
    elif idempotent is not None and idempotent is not mode:
        raise ConfigError(f"kafka.producer_options.enable_idempotence is {mode}")
    return with_options(managed, k.producer_options, AIOKafkaProducer, "producer_options")


def idempotence(k: KafkaConfig) -> bool | Literal["auto"]:
    """``kafka.enable_idempotence``, or ``kafka.producer_options.enable_idempotence``
    where an operator set it there (it passed through before the key existed and
    still does): an explicit choice, so no fallback."""
    option = k.producer_options.get("enable_idempotence")
    if option is None:
        return k.enable_idempotence
    name = "kafka.producer_options.enable_idempotence"
    if not isinstance(option, bool):
        raise ConfigError(f"{name}: expected true/false, got {option!r}")
    if k.enable_idempotence != "auto" and k.enable_idempotence is not option:
        raise ConfigError(f"{name}: {option} contradicts kafka.enable_idempotence")
    return option


async def start_producer(k: KafkaConfig) -> tuple[AIOKafkaProducer, bool]:
    """The results producer, started, and whether it is idempotent.

    With ``kafka.enable_idempotence = "auto"`` the idempotent producer is tried
    first. Its ``start()`` asks the broker for a producer id (InitProducerId); a
    broker that refuses (the embedded one answers UNKNOWN), or does not answer
    within ``request_timeout_ms``, gets a warning and a producer without. Probing
    the broker's API versions instead would not do: the embedded broker lists
    InitProducerId among them and then fails it. A broker that cannot be reached
    at all fails both attempts, with the connection error, as before."""
    mode = idempotence(k)
    if mode != "auto":
        return await started(AIOKafkaProducer(**producer_kwargs(k, mode))), mode
    try:
        producer = await asyncio.wait_for(
            started(AIOKafkaProducer(**producer_kwargs(k, True))), k.request_timeout_s
        )
    except (BrokerResponseError, TimeoutError) as exc:
        log.warning(
            "idempotence_unavailable",
            error=repr(exc) if str(exc) else type(exc).__name__,
            effect="results are produced without idempotence: a send the producer "
            "retries may write a result twice (same source)",
            silence="kafka.enable_idempotence = false",
        )
        return await started(AIOKafkaProducer(**producer_kwargs(k, False))), False
    return producer, True


async def start_transactional_producer(k: KafkaConfig) -> tuple[AIOKafkaProducer, bool]:
    """The exactly-once results producer, started: transactional (hence
    idempotent), with this member's transactional id.

    Its ``start()`` sends InitProducerId for that id, which also fences an
    earlier incarnation of this member: the broker aborts that one's open
    transaction, and its later transactional requests fail (ProducerFenced). A
    broker that refuses it (the embedded one answers UNKNOWN) or does not
    answer within ``request_timeout_ms`` cannot give exactly-once: that is a
    configuration error (exit 2), not something to fall back from silently."""
    kwargs = {
        **producer_kwargs(k, True),
        "transactional_id": transactional_id(k),
        "transaction_timeout_ms": k.transaction_timeout_ms,
    }
    try:
        producer = await asyncio.wait_for(started(AIOKafkaProducer(**kwargs)), k.request_timeout_s)
    except (BrokerResponseError, TimeoutError) as exc:
        if (not_allowed := refused(exc, k)) is not None:
            raise not_allowed from exc
        raise ConfigError(
            'kafka.processing_guarantee = "exactly-once": the broker at '
            f"{k.bootstrap_servers} gave no transactional producer (InitProducerId for "
            f"transactional id {transactional_id(k)!r}: "
            f"{repr(exc) if str(exc) else type(exc).__name__}). Exactly-once needs a "
            "broker with transactions (Apache Kafka; not the embedded broker) whose "
            '__transaction_state topic can be created; or use "at-least-once"'
        ) from exc
    return producer, True


_Client = TypeVar("_Client", AIOKafkaProducer, AIOKafkaConsumer)


async def started(client: _Client) -> _Client:
    """``client`` (an aiokafka producer or consumer) started; closed again if its
    start fails or is cancelled (left open, aiokafka warns "Unclosed" at exit)."""
    try:
        await client.start()
    except BaseException:
        await client.stop()
        raise
    return client


def with_options(
    managed: Mapping[str, Any], options: Mapping[str, Any], client: type[Any], section: str
) -> dict[str, Any]:
    """``managed`` plus the operator's pass-through ``options``, refusing (with the
    setting's name) arguments the worker sets itself and ones aiokafka lacks, so
    a typo stops the worker at start-up instead of a TypeError deep in a stage."""
    for key in options:
        name = f"kafka.{section}.{key}"
        if key in managed or key in _NEVER:
            raise ConfigError(
                f"{name}: set by the worker itself (use the kafka.* setting where one "
                "exists; serialisers, auto-commit and transactions are not configurable)"
            )
        if key not in inspect.signature(client).parameters:
            raise ConfigError(f"{name}: not an argument of aiokafka's {client.__name__}")
    return {**managed, **options}


def client_kwargs(k: KafkaConfig) -> dict[str, Any]:
    """aiokafka keyword arguments for bootstrap, identity, security, and how old
    the worker's clients let their metadata grow."""
    return {**connection(k), "metadata_max_age_ms": k.metadata_max_age_ms}


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    """``topic``'s partitions, from a metadata request for every topic (which,
    unlike one naming the topic, never auto-creates it); empty where it does not
    exist.

    ``await consumer.topics()`` then ``consumer.partitions_for_topic(topic)``
    looks like the same thing and is not: ``topics()`` fills a metadata object
    of its own, and the consumer's cache holds what its bootstrap asked for,
    which on Apache Kafka is no topic at all (aiokafka bootstraps with a request
    for an empty topic list; the embedded broker answers that with every topic,
    which hid the difference). aiokafka has no public call for this."""
    cluster = await consumer._client.fetch_all_metadata()
    return set(cluster.partitions_for_topic(topic) or ())


async def close_within(
    name: str, closer: Callable[[], Coroutine[Any, Any, None]], limit: float
) -> None:
    """Run one client's close; failures and overruns are logged, never raised. A
    CancelledError from inside the client (aiokafka's fetcher raises one while
    it closes against an unreachable broker) is its failure, not ours, unless
    this task itself is being cancelled."""
    try:
        await asyncio.wait_for(closer(), limit)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("close_interrupted", client=name)
    except TimeoutError:
        log.warning("close_timed_out", client=name, seconds=round(limit, 2))
    except Exception as exc:  # boundary: whatever the client raises while closing
        log.warning("close_failed", client=name, error=repr(exc))
