"""Monitors beside the consumer: whether the broker answers (the "broker"
readiness condition and the input topics' presence), and each assigned
partition's lag and commit age (gauges), refreshed every few seconds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from worker.flow.messages import TopicPartition
from worker.kafka.consumer import Consumer
from worker.obs import metrics

log = structlog.get_logger(__name__)


async def watch_broker(source: Consumer, timeout: float, interval: float = 1.0) -> None:
    """Keep the "broker" and "topics" readiness conditions current while the
    worker runs: an input topic deleted under a running worker makes it not
    ready, where the cluster does not create topics on demand (with
    ``auto.create.topics.enable=true``, and on the embedded broker, aiokafka's
    own metadata refresh re-creates it at once, empty: measured)."""
    up, missing = True, list[str]()
    while True:
        ok = await source.probe(timeout)
        if ok != up:
            log.warning("broker_reachable" if ok else "broker_unreachable")
            up = ok
        if source.missing_topics != missing:
            missing = source.missing_topics
            if missing:
                log.error("input_topics_missing", topics=missing)
            else:
                log.info("input_topics_found")
        metrics.set_condition("broker", ok)
        metrics.set_condition("topics", not missing)
        await asyncio.sleep(interval)


async def report_partitions(
    source: Consumer,
    committed: Callable[[TopicPartition], int | None],
    last_commit: dict[TopicPartition, float],
    interval: float = 5.0,
) -> None:
    """Per-partition lag and commit age for the partitions this member owns.

    Lag is the high watermark the last fetch saw minus the committed offset: what
    the group still has to answer on this partition, as the broker's own
    consumer-group lag would say (``end_offsets`` is not used: the embedded
    broker answers it wrongly)."""
    while True:
        consumer = source.client
        now = time.monotonic()
        if consumer is not None:
            for ktp in consumer.assignment():
                tp = TopicPartition(ktp.topic, ktp.partition)
                labels = (tp.topic, str(tp.partition))
                high, done = consumer.highwater(ktp), committed(tp)
                if high is not None and done is not None:
                    metrics.PARTITION_LAG.labels(*labels).set(max(0, high - done))
                if tp in last_commit:
                    metrics.PARTITION_COMMIT_AGE.labels(*labels).set(now - last_commit[tp])
        await asyncio.sleep(interval)
