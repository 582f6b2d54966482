"""Monitors beside the consumer: whether the broker answers (the "broker"
readiness condition and the input topics' presence), and each assigned
partition's lag and commit age, with each model's backlog and seconds to drain
(gauges), refreshed every few seconds (``metrics.lag_interval_ms``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import structlog
from aiokafka.errors import KafkaError

from worker.config.models import Routing
from worker.flow.drain import Shares, backlog_by_model
from worker.flow.messages import TopicPartition
from worker.kafka.consumer import Consumer
from worker.obs import backlog, metrics

log = structlog.get_logger(__name__)


async def watch_broker(source: Consumer, timeout: float, interval: float = 1.0) -> None:
    """Keep the "broker" and "topics" readiness conditions current while the
    worker runs: an input topic deleted under a running worker makes it not
    ready, where the cluster does not create topics on demand (with
    ``auto.create.topics.enable=true``, and on the embedded broker, aiokafka's
    own metadata refresh re-creates it at once, empty: measured)."""
    up, missing = True, list[str]()
    while True:
        ok, found_missing = await probe(source, timeout)
        if ok != up:
            log.warning("broker_reachable" if ok else "broker_unreachable")
            up = ok
        if found_missing is not None and found_missing != missing:
            missing = found_missing
            if missing:
                log.error("input_topics_missing", topics=missing)
            else:
                log.info("input_topics_found")
        metrics.set_condition("broker", ok)
        metrics.set_condition("topics", not missing)
        await asyncio.sleep(interval)


async def probe(source: Consumer, timeout: float) -> tuple[bool, list[str] | None]:
    """Whether the cluster answers a metadata request for the input topics within
    ``timeout``, and the input topics it does not know (deleted since start-up;
    None when it did not answer). The consumer hides connection loss (it
    reconnects quietly and returns empty fetches), so readiness needs an
    explicit round trip; it asks for the subscribed topics only (the consumer's
    own metadata refresh), not the whole cluster's, which twenty workers
    probing every second would make the brokers pay for."""
    if source.client is None:
        return False, None
    # aiokafka has no public per-topic metadata call; this is the refresh the
    # consumer runs every metadata_max_age_ms, brought forward.
    client = source.client._client
    try:
        updated = await asyncio.wait_for(client.force_metadata_update(), timeout)
    except (KafkaError, TimeoutError, OSError):
        return False, None
    if not updated:
        return False, None
    known = client.cluster.topics()
    return True, [t for t in source.input_topics if t not in known]


async def report_partitions(
    source: Consumer,
    committed: Callable[[TopicPartition], int | None],
    last_commit: dict[TopicPartition, float],
    routing: Routing,
    shares: Shares,
    interval: float = 5.0,
    observe: Callable[[Mapping[str, int]], None] | None = None,
) -> None:
    """Per-partition lag and commit age for the partitions this member owns, and
    from the same lags each model's backlog and seconds to drain
    (``worker.flow.drain``: a topic's lag is its model's or pipeline's, a shared
    topic's split by ``shares``, the intake's count), so all of them describe
    one moment.

    Lag is the high watermark the last fetch saw minus the committed offset: what
    the group still has to answer on this partition, as the broker's own
    consumer-group lag would say (``end_offsets`` is not used: the embedded
    broker answers it wrongly); until this member commits a partition, the
    group's offset it was assigned at (none: 0 where the partition is empty,
    else unknown and not reported). A model whose partitions all left this member
    loses its series at the next poll; all of them go when the task ends.
    ``observe``: told each poll's backlogs by model (models loaded by demand are
    loaded ahead of their requests by it: ``worker.app.demand``)."""
    try:
        while True:
            consumer = source.client
            now = time.monotonic()
            lags: list[tuple[str, int]] = []
            if consumer is not None:
                for ktp in consumer.assignment():
                    tp = TopicPartition(ktp.topic, ktp.partition)
                    labels = (tp.topic, str(tp.partition))
                    high, done = source.highwater(ktp), committed(tp)
                    if done is None:  # not committed by this member yet: the group's
                        done = source.committed_at_assignment.get(tp, 0 if high == 0 else None)
                    if high is not None and done is not None:
                        lag = max(0, high - done)
                        metrics.PARTITION_LAG.labels(*labels).set(lag)
                        lags.append((tp.topic, lag))
                    if tp in last_commit:
                        metrics.PARTITION_COMMIT_AGE.labels(*labels).set(now - last_commit[tp])
            backlogs = backlog_by_model(lags, routing.owner, routing.shared, shares)
            backlog.publish(backlogs, now)
            if observe is not None:
                observe(backlogs)
            shares.decay()
            await asyncio.sleep(interval)
    finally:
        backlog.withdraw_all()
