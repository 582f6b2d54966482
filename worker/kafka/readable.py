"""Fetching only what is readable: the partitions assigned and not paused."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Final, cast

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord
from aiokafka.structs import TopicPartition as KafkaTP

from worker.flow.deadline import Deadline

Fetched = dict[KafkaTP, list[ConsumerRecord[Any, Any]]]

# A partition no member is ever assigned: named alone, ``getmany`` polls (the
# member stays in the group: max_poll_interval_ms) and returns nothing.
NO_PARTITION: Final = KafkaTP("", -1)
# The longest one ``getmany`` waits before the partitions it names are decided again.
SLICE_MS: Final = 5


async def getmany_readable(
    consumer: AIOKafkaConsumer,
    timeout_ms: int,
    among: Iterable[KafkaTP] | None = None,
    max_records: int | None = None,
) -> Fetched:
    """``getmany`` naming only the partitions (of ``among``, default: every one
    assigned) that are not paused.

    aiokafka drops a paused partition's fetched records whenever a ``getmany``
    covers it (``FetchResult.check_assignment``), so the partition is fetched
    again from its position once resumed. The worker pauses at its in-flight
    bound, with a fetch of up to ``max_partition_fetch_bytes`` buffered for
    most partitions: a plain ``getmany()`` then dropped them all, every pause,
    and a 100,000-record drain fetched 4.6 times its records' bytes (169 MB
    for 37; BENCHMARKS.md, "Fetched once"). Named only the readable ones, a
    paused partition's records wait in aiokafka's buffer until the resume.

    The partitions named are decided again every ``SLICE_MS`` of the wait: a
    partition resumed (or assigned) while it waits is read within that, not
    after the whole timeout (an urgent lane's records resumed during its
    fetcher's 50 ms wait)."""
    budget = Deadline(timeout_ms / 1000.0)
    while True:
        paused = consumer.paused()
        chosen = consumer.assignment() if among is None else among
        tps = [tp for tp in chosen if tp not in paused]
        wait_ms = min(SLICE_MS, math.ceil(budget.left() * 1000.0))
        fetched = await consumer.getmany(
            *(tps or [NO_PARTITION]), timeout_ms=wait_ms, max_records=max_records
        )
        if fetched or budget.expired:
            return cast(Fetched, fetched)
