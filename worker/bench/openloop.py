"""Open-loop Poisson arrivals at a rate, and what came back: the measurement the
sweep makes at every grid point and ``bench --model`` makes once (``paced``).

Arrivals are sent on their schedule whatever the worker does (open loop), so a
worker that falls behind shows as latency and as answers/s below the rate,
never as a slower sender. Each point records what was offered, what was
answered per second, the end-to-end latency percentiles and the mean batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np

from worker.bench.payloads import Value, request_records
from worker.bench.senders import produce_open_loop, sender_count
from worker.config import Settings
from worker.ops.processes import WorkerProcess, mean_batch_size, summed
from worker.ops.topics import Collected, Collector, Produced

# A rate is sustained when everything was answered ok and the answers kept up
# with the arrivals: answered/s >= this fraction of the rate actually offered.
SUSTAINED_FRACTION: Final = 0.95
# Beyond sending, how long a rate may take to be answered: max(this, 3 x duration).
DRAIN_SECONDS: Final = 20.0
STAGES: Final = ("queue", "preprocess", "infer", "d2h", "total")
BATCH_KEY: Final = "batching.max_batch_size"
DELAY_KEY: Final = "batching.max_queue_delay_ms"


def number(x: float) -> str:
    """A setting's value as TOML and the environment read it back: 2, 2.5."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True)
class Setting:
    max_batch_size: int
    max_queue_delay_ms: float

    def overrides(self) -> dict[str, str]:
        return {BATCH_KEY: str(self.max_batch_size), DELAY_KEY: number(self.max_queue_delay_ms)}

    def label(self) -> str:
        return f"batch {self.max_batch_size}, delay {number(self.max_queue_delay_ms)} ms"


@dataclass
class SweepPoint:
    """One setting at one arrival rate."""

    max_batch_size: int
    max_queue_delay_ms: float
    rate: float  # target mean arrival rate, requests/s
    sent: int
    answered: int = 0  # ok results
    errors: int = 0  # error results and dead-lettered records
    offered: float = 0.0  # the rate actually sent: sent / (last send - first send)
    # answered / (last answer - first answer): each rate over the span of its own
    # events. Over (last answer - first send) a worker that kept up looked slower
    # by the latency (2 s of arrivals, 0.27 s p99: 89/s "answered" of 100/s offered
    # on a loaded 2-core machine, called not sustained).
    throughput: float = 0.0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    mean_batch_size: float = 0.0
    seconds: float = 0.0  # first send to last answer
    complete: bool = True  # False: the answers did not all arrive in time

    @property
    def setting(self) -> Setting:
        return Setting(self.max_batch_size, self.max_queue_delay_ms)

    @property
    def sustained(self) -> bool:
        return (
            self.complete
            and self.answered == self.sent
            and self.errors == 0
            and self.throughput >= SUSTAINED_FRACTION * self.offered
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "sustained": self.sustained}


class _Tally:
    """Counts the answers (results and DLQ records) to one rate's requests, known
    by their key prefix, scanning only what arrived since the last call."""

    def __init__(self, collector: Collector, prefix: bytes, expect: int) -> None:
        self.prefix, self.expect, self.count = prefix, expect, 0
        self._seen = {t: len(collector.records[t]) for t in collector.topics}
        self.start = dict(self._seen)

    def __call__(self, collector: Collector) -> bool:
        for topic, seen in self._seen.items():
            records = collector.records[topic]
            self.count += sum(1 for r in records[seen:] if self._ours(r))
            self._seen[topic] = len(records)
        return self.count >= self.expect

    def _ours(self, record: Collected) -> bool:
        return record.record_key is not None and record.record_key.startswith(self.prefix)

    def answers(self, collector: Collector, topic: str) -> list[Collected]:
        return [r for r in collector.records[topic][self.start[topic] :] if self._ours(r)]


async def send_open_loop(
    bootstrap: str,
    collector: Collector,
    topics: Mapping[str, str],
    records: Sequence[tuple[bytes | None, bytes]],
    point: SweepPoint,
    *,
    prefix: bytes,
    partitions: int,
    senders: int = 1,
) -> list[Collected]:
    """Send ``records`` (every key starts with ``prefix``) as open-loop Poisson
    arrivals at ``point.rate`` over ``partitions``, from ``senders`` processes
    (``worker.bench.senders``), while ``collector`` (started,
    reading the results and DLQ topics) gathers their answers; fills in
    ``point`` (answered, errors, offered rate, throughput, latency percentiles,
    complete) and returns the result records of these requests."""
    n = len(records)
    tally = _Tally(collector, prefix, n)
    timeout = n / point.rate + max(DRAIN_SECONDS, 3 * n / point.rate)
    collecting = asyncio.create_task(collector.collect(tally, timeout))
    produced = await produce_open_loop(
        bootstrap,
        topics["requests"],
        records,
        partition_of=lambda i: i % partitions,
        rate=point.rate,
        senders=senders,
    )
    point.complete = await collecting
    _score(point, tally, collector, topics, produced)
    return tally.answers(collector, topics["results"])


def _score(
    point: SweepPoint,
    tally: _Tally,
    collector: Collector,
    topics: Mapping[str, str],
    produced: list[Produced],
) -> None:
    sent_at = {p.key: p.sent_at for p in produced}
    latencies = []
    received = []
    for rec in tally.answers(collector, topics["results"]):
        if rec.result().status != "ok" or rec.record_key not in sent_at:
            point.errors += 1
            continue
        point.answered += 1
        latencies.append(rec.received_at - sent_at[rec.record_key])
        received.append(rec.received_at)
    point.errors += len(tally.answers(collector, topics["dlq"]))
    first, final = min(sent_at.values()), max(sent_at.values())
    point.offered = point.sent / (final - first) if final > first else point.rate
    if received and max(received) > first:
        point.seconds = max(received) - first
        span = max(received) - min(received)
        point.throughput = point.answered / span if span > 0 else point.offered
    if latencies:
        ms = np.array(latencies) * 1000
        p50, p95, p99 = np.percentile(ms, [50, 95, 99])
        point.p50_ms, point.p95_ms, point.p99_ms = float(p50), float(p95), float(p99)
        point.max_ms = float(ms.max())


def percentiles_ms(values_us: Sequence[float], qs: Sequence[float]) -> list[float]:
    if not values_us:
        return [0.0 for _ in qs]
    return [round(float(v) / 1000.0, 3) for v in np.percentile(np.asarray(values_us), qs)]


def stage_summary(timings: Iterable[Mapping[str, int]]) -> dict[str, dict[str, float]]:
    """p50 and p99 of each stage of ``timing_us``, in ms: the contract's stages
    first, then any other the results carried (missing where no result had it)."""
    by_stage: dict[str, list[float]] = {}
    for timing in timings:
        for stage, us in timing.items():
            by_stage.setdefault(stage, []).append(float(us))
    order = [s for s in STAGES if s in by_stage] + sorted(set(by_stage) - set(STAGES))
    out = {}
    for stage in order:
        p50, p99 = percentiles_ms(by_stage[stage], [50, 99])
        out[stage] = {"p50_ms": p50, "p99_ms": p99}
    return out


async def paced(
    bootstrap: str,
    settings: Settings,
    topics: Mapping[str, str],
    worker: WorkerProcess,
    collector: Collector,
    name: str,
    inputs: Sequence[Value],
    *,
    rate: float,
    duration: float,
    procs: int,
    partitions: int,
    senders: int = 1,
) -> dict[str, Any]:
    """``bench --model``'s paced run: ``rate`` requests/s for ``duration`` seconds
    from ``senders`` processes to the running ``worker`` (``run --procs procs``);
    latencies end to end and per stage (the results' ``timing_us``), and the mean
    batch meanwhile."""
    n = max(1, round(rate * duration))
    records = request_records(name, inputs, "paced", n)
    before = summed(await asyncio.to_thread(worker.member_metrics, procs))
    b = settings.batching
    point = SweepPoint(b.max_batch_size, b.max_queue_delay_ms, rate, n)
    answers = await send_open_loop(
        bootstrap, collector, topics, records, point,
        prefix=b"paced-", partitions=partitions, senders=senders,
    )  # fmt: skip
    after = summed(await asyncio.to_thread(worker.member_metrics, procs))
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    decoded = [r.result() for r in answers]
    return {
        "rate": round(rate, 1),
        "offered": round(point.offered, 1),
        "senders": sender_count(senders, point.sent),
        "sent": point.sent,
        "answered": point.answered,
        "errors": point.errors,
        "throughput": round(point.throughput, 1),
        "sustained": point.sustained,
        "p50_ms": round(point.p50_ms, 3),
        "p95_ms": round(point.p95_ms, 3),
        "p99_ms": round(point.p99_ms, 3),
        "max_ms": round(point.max_ms, 3),
        "mean_batch": round(mean_batch_size(delta), 2),
        "stages": stage_summary(r.timing_us for r in decoded if r.status == "ok"),
    }
