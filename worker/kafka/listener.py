"""The group consumer's rebalance listener: revocations go to the pipeline,
assignments to the consumer, which positions the new partitions before any of
their records is read (``Consumer.start_at_committed``)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import structlog
from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.messages import TopicPartition
from worker.obs import metrics

log = structlog.get_logger(__name__)

RevokeHook = Callable[[set[TopicPartition]], Awaitable[None]]


class Source(Protocol):
    """What the listener needs of ``worker.kafka.consumer.Consumer``."""

    def revoking(self) -> None: ...

    async def start_at_committed(self, tps: list[KafkaTP]) -> None: ...


async def settle(on_revoke: RevokeHook, revoked: Iterable[KafkaTP]) -> None:
    """``on_revoke`` for ``revoked``: a failure recorded and surfaced
    (``infer_rebalance_listener_errors_total``), never raised into aiokafka."""
    try:
        await on_revoke({TopicPartition(tp.topic, tp.partition) for tp in revoked})
    except Exception as exc:  # recorded and surfaced, never swallowed silently
        metrics.LISTENER_ERRORS.inc()
        log.error("rebalance_revoke_failed", error=repr(exc))


class RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Forwards revocations to the pipeline; aiokafka only logs listener errors, so
    we count them (``infer_rebalance_listener_errors_total``) and log them as errors."""

    def __init__(self, source: Source, on_revoke: RevokeHook) -> None:
        self._source = source
        self._on_revoke = on_revoke

    async def on_partitions_revoked(self, revoked: Iterable[KafkaTP]) -> None:
        tps = {TopicPartition(tp.topic, tp.partition) for tp in revoked}
        metrics.REBALANCES.labels(kind="revoked").inc()
        metrics.ASSIGNED_PARTITIONS.set(0)
        for tp in tps:  # their series would otherwise report a stale lag for ever
            with contextlib.suppress(KeyError):
                metrics.PARTITION_LAG.remove(tp.topic, str(tp.partition))
                metrics.PARTITION_COMMIT_AGE.remove(tp.topic, str(tp.partition))
        if not tps:
            return
        self._source.revoking()
        await settle(self._on_revoke, revoked)

    async def on_partitions_assigned(self, assigned: Iterable[KafkaTP]) -> None:
        tps = list(assigned)
        names = sorted(f"{t.topic}:{t.partition}" for t in tps)
        try:
            await self._source.start_at_committed(tps)
        except Exception as exc:  # recorded; the consumer's own reset policy applies
            metrics.LISTENER_ERRORS.inc()
            log.error("rebalance_assign_failed", error=repr(exc))
        metrics.ASSIGNED_PARTITIONS.set(len(names))
        metrics.REBALANCES.labels(kind="assigned").inc()
        log.info("partitions_assigned", partitions=names)
