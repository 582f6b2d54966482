"""The run's priority lanes, built once from the settings (``kafka.ranked_lanes``):
the batching policy (one FIFO ``BatchPolicy`` without lanes, exactly as before
lanes existed; ``LanePolicy`` with them, for the CPU and the GPU stage alike),
the backpressure per lane, and the per-lane metrics of each batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from worker.config import BatchingConfig, Settings
from worker.flow.batching import BatchPolicy, Policy
from worker.flow.lanes import Lane, LaneBackpressure, LanePolicy
from worker.flow.messages import Batch, Job
from worker.flow.throttle import lane_throttle
from worker.obs import metrics


def lanes_of(s: Settings) -> tuple[Lane, ...]:
    delay_ms = s.batching.max_queue_delay_ms
    return tuple(
        Lane(
            rank=r,
            name=lane.label,
            delay=(delay_ms if lane.max_queue_delay_ms is None else lane.max_queue_delay_ms)
            / 1000.0,
            min_share=lane.min_share,
            max_rate=lane.max_records_per_s,
        )
        for r, lane in enumerate(s.kafka.ranked_lanes)
    )


def batch_policy(s: Settings) -> Policy[Job]:
    b = s.batching
    lanes = lanes_of(s)
    rank = s.kafka.lane_rank
    names = [lane.name for lane in lanes]

    def observe(batch: Batch[Job]) -> None:
        by_lane: dict[int, list[float]] = {}
        for job in batch.items:
            by_lane.setdefault(rank[job.tp.topic], []).append(batch.formed_at - job.arrived)
        for r, waits in by_lane.items():
            metrics.LANE_ROWS.labels(lane=names[r]).inc(len(waits))
            metrics.observe_all(metrics.LANE_QUEUE_SECONDS.labels(lane=names[r]), waits)

    if len(lanes) == 1:
        # One lane: FIFO exactly as before lanes existed; its lane's metrics only
        # where it is a configured lane (one served by a process of its own).
        return BatchPolicy(b.max_batch_size, lanes[0].delay, b.preferred_batch_sizes,
                           observe=observe if s.kafka.lanes else None,
                           throttle=lane_throttle(lanes[0].max_rate, b.max_batch_size))  # fmt: skip
    return LanePolicy(
        lanes,
        lambda job: rank[job.tp.topic],
        b.max_batch_size,
        capacity=b.queue_capacity,
        observe=observe,
    )


# With several models, a model's records in flight when the bound is left to derive:
# a lone model's (2 x batch x batches in flight, at least 1,024) let one model's
# backlog hold the loop and the writer ahead of another's requests (p99 5.7x alone
# beside a 100,000-record backlog); one batch of its own, at least 256: about 1.5x,
# the drain no slower (BENCHMARKS.md, several models).
APART_MIN_INFLIGHT = 256


def apart_bound(b: BatchingConfig) -> int:
    """A model's in-flight record bound where several models share the worker."""
    if not b.inflight_derived:
        return b.max_inflight_records  # the operator's
    return max(APART_MIN_INFLIGHT, b.max_batch_size)


def backpressure(
    s: Settings, models: Sequence[Settings] = (), owners: Mapping[str, int] | None = None
) -> tuple[LaneBackpressure, dict[str, int] | None]:
    """Pausing, and each input topic's rank in it. One model: per lane over the
    worker's in-flight counts (the topics' ranks: their lanes'). Several models
    or pipelines (``models``: each one's settings as it runs; ``owners``: each
    input topic's model, by its place in ``models``): per model over each one's
    own counts at its own bounds, so one model's backlog pauses only its topics;
    with priority lanes too, one decision per (model, lane) on the model's
    counts, the urgent lane's bounds the higher (it pauses last)."""
    b = s.batching
    if len(models) <= 1 or owners is None:
        lanes = len(s.kafka.ranked_lanes)
        return LaneBackpressure(b.max_inflight_records, b.max_inflight_bytes, lanes=lanes), None
    k = s.kafka
    n = len(k.ranked_lanes)
    pairs = sorted({(owners[t], k.lane_rank.get(t, 0)) for t in k.input_topics})
    bounds, labels = [], []
    for m, lane in pairs:
        bc, f = models[m].batching, LaneBackpressure.scale(lane, n)
        bounds.append((int(apart_bound(bc) * f), int(bc.max_inflight_bytes * f)))
        labels.append(models[m].model.name + (f"/{k.ranked_lanes[lane].label}" if n > 1 else ""))
    groups = [m for m, _ in pairs] if n > 1 else None
    rank = {pair: i for i, pair in enumerate(pairs)}
    ranks = {t: rank[owners[t], k.lane_rank.get(t, 0)] for t in k.input_topics}
    return LaneBackpressure.per_model(bounds, labels, groups=groups), ranks
