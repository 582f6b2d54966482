"""Which lanes' partitions are read, and in what order (``[[kafka.lanes]]``;
without lanes, one lane: everything as before).

``apply_backpressure`` pauses and resumes each lane's partitions as
``LaneBackpressure`` decides (the lowest lane first, resumed last). Two things
in aiokafka put an urgent record behind a lower lane's:

- ``getmany()`` fills its ``max_records`` from the partitions' buffered records
  in turn, so a bulk partition holding thousands returns 500 of them while the
  urgent records buffered beside them wait for later calls: ``getmany_by_lane``
  asks each lane's partitions first, most urgent first;
- a node's next fetch waits up to ``prefetch_backoff`` (0.1 s) while any of its
  partitions has records not yet taken: ``fetch_for_lanes`` shortens it.

Measured before these (Apache Kafka, 2 cores): an urgent record was 130-156 ms
old (p50) when ``getmany`` returned it while a bulk lane drained
(BENCHMARKS.md, priority lanes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition as KafkaTP

from worker.config import KafkaConfig
from worker.flow.lanes import LaneBackpressure
from worker.kafka.readable import Fetched, getmany_readable
from worker.kafka.urgentfetch import UrgentFetcher
from worker.obs import metrics

log = structlog.get_logger(__name__)

LANES_PREFETCH_BACKOFF_S: Final = 0.005
# With lanes, a lower lane's records are taken in at most this many at a time:
# the consumer takes a getmany's records in (decodes and checks them, on the
# event loop) before it asks for more, so an urgent record fetched meanwhile
# waited for all of a lower lane's buffered records (hundreds) to be taken in.
LOWER_LANE_RECORDS: Final = 64


def fetch_timeout_ms(bp: LaneBackpressure) -> int:
    """How long the consumer's next fetch may wait for records: 200 ms; 50 while
    a lane is paused, so it resumes soon after the pipeline drains; 0 while
    every lane is, when there is nothing to fetch and the consumer waits for the
    next acknowledgement instead (``Consumer.run``), which a fetch's wait could
    not be cut short by: the pipeline then ran dry for up to 50 ms at a time
    (BENCHMARKS.md, "Resuming at the acknowledgement")."""
    if bp.all_paused:
        return 0
    return 50 if bp.paused else 200


def lane_of(k: KafkaConfig, tp: KafkaTP) -> int:
    """The rank of the partition's lane (0 = most urgent)."""
    return k.lane_rank.get(tp.topic, 0)


def apply_backpressure(
    consumer: AIOKafkaConsumer,
    k: KafkaConfig,
    bp: LaneBackpressure,
    counts: list[tuple[int, int]],
    positioning: set[KafkaTP],
    urgent: UrgentFetcher | None = None,
    rank_of: Callable[[KafkaTP], int] | None = None,
) -> None:
    """Pause or resume each lane's partitions for what is in flight (``counts``:
    the records and bytes, one pair for every lane, or one per model where
    ``bp.apart``, whose ``rank_of`` says each partition's model); partitions
    still being positioned stay paused (their positioning resumes them), and
    those the ``urgent`` fetcher reads stay paused in the group consumer (the
    fetcher follows the most urgent lane's state instead)."""
    rank_of = rank_of or (lambda t: lane_of(k, t))
    changes = bp.update_each(counts) if bp.apart else bp.update(*counts[0])
    for rank, action in changes:
        records, nbytes = counts[rank] if bp.apart else counts[0]
        if bp.apart:  # a model's partitions: not a lane
            who = {"model": bp.labels[rank]}
        else:
            who = {"lane": k.ranked_lanes[rank].label}
            metrics.LANE_PAUSED.labels(**who).set(1 if action == "pause" else 0)
        if action == "pause":
            metrics.PAUSES.inc()
            log.info("fetch_paused", **who, inflight_records=records, inflight_bytes=nbytes)
        else:
            held = set() if urgent is None else urgent.held()
            consumer.resume(
                *(t for t in consumer.paused() - positioning - held if rank_of(t) == rank)
            )
            metrics.RESUMES.inc()
            log.info("fetch_resumed", **who, inflight_records=records, inflight_bytes=nbytes)
    if changes and urgent is not None:  # its partitions follow their ranks' state
        urgent.follow(lambda t: bp.is_paused(rank_of(t)))
    if bp.paused:
        # Also covers partitions assigned by a rebalance while paused.
        consumer.pause(*(t for t in consumer.assignment() if bp.is_paused(rank_of(t))))


def fetch_for_lanes(consumer: AIOKafkaConsumer, k: KafkaConfig, apart: bool = False) -> bool:
    """With lanes, or several models paused apart (``apart``), a node's next fetch
    waits at most 5 ms for another partition's records to be taken: one model's
    backlog, buffered, must not hold back the fetch of another's new records.
    aiokafka does not take ``prefetch_backoff`` as a consumer argument, so it is
    set on the started consumer's fetcher (an attribute since aiokafka 0.5; a
    unit test holds it in the installed version). False where the attribute is
    missing (nothing changed)."""
    fetcher = getattr(consumer, "_fetcher", None)
    if not (k.has_lanes or apart) or not hasattr(fetcher, "_prefetch_backoff"):
        return False
    fetcher._prefetch_backoff = LANES_PREFETCH_BACKOFF_S  # type: ignore[union-attr]
    return True


async def getmany_by_lane(
    consumer: AIOKafkaConsumer, k: KafkaConfig, timeout_ms: int, lower_records: int | None = None
) -> Fetched:
    """Records already fetched for the most urgent lane that has some, else a
    wait on every readable partition (``getmany`` as without lanes). ``lower_records``:
    at most this many records of a lower lane at a time (``LOWER_LANE_RECORDS``)."""
    if not k.has_lanes:
        return await getmany_readable(consumer, timeout_ms)
    assigned = consumer.assignment()
    by_lane = [[tp for tp in assigned if lane_of(k, tp) == r] for r in range(len(k.ranked_lanes))]

    async def ready(r: int) -> Fetched:
        """Lane ``r``'s records already fetched (a lower lane's, up to the cap)."""
        if not by_lane[r]:
            return {}
        limit = None if r == 0 else lower_records
        return await getmany_readable(consumer, 0, by_lane[r], limit)

    for r in range(len(by_lane)):
        if got := await ready(r):
            return got
    fetched = await getmany_readable(consumer, timeout_ms, max_records=lower_records)
    # The wait hands over the first records buffered, up to the cap: a lower
    # lane's may fill it while a more urgent lane's came in the same fetch.
    for r in range(min((lane_of(k, tp) for tp in fetched), default=0)):
        fetched = {**await ready(r), **fetched}
    return fetched
