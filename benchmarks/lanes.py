"""Priority lanes under overload: an urgent lane at a fixed rate while a bulk
lane holds a backlog, with lanes and without (issue 39).

    .venv/bin/python -m benchmarks.lanes --broker kafka --backlog 100000 \\
        --share 0.2 --seconds 10 [--json out.json]

One broker (a single-node Apache Kafka with ``--broker kafka``), the bundled
digits model, one worker process per scenario, each on fresh topics and group:

1. ``capacity``: the worker drains ``--backlog`` bulk requests alone; its rate
   (first to last result) is the capacity C.
2. ``urgent alone``: urgent requests, open-loop Poisson at ``--share`` x C for
   ``--seconds``, nothing else: the urgent p50/p99 to hold.
3. ``lanes``: the same urgent arrivals while the worker drains the bulk backlog,
   the two topics in two lanes (``[[kafka.lanes]]``, urgent first).
4. ``no lanes``: the same, both topics in ``kafka.input_topics`` alone.
5. ``lanes-own``: as ``lanes``, the urgent lane with ``own_process = true``
   (``run`` serves it from a second process of the same group).
6. ``lanes-cap`` and ``lanes-own-cap`` (only with ``--only``): as ``lanes`` and
   ``lanes-own``, the bulk lane held to ``--bulk-cap`` x the capacity the urgent
   lane leaves (its ``max_records_per_s``).
7. ``models-alone`` and ``models`` (only with ``--only``): no lanes, the bulk
   topic served by a second model of the same worker (``[models.bulk]``, the
   digits model again), the urgent topic by ``[model]``: the urgent p99 alone,
   then while the other model drains the backlog (several models in one worker).
8. ``urgent-loaded`` (only with ``--only``): the urgent lane alone again, while
   ``benchmarks.lanes_load`` copies the backlog to the results topic at the bulk
   lane's rate (``--load-rate``): the broker's and this reader's share of a
   drain on a shared host, without the worker's own bulk work.

Latency is worker-side: the result record's Kafka timestamp minus its request's
(both stamped by producers on this host). Bulk throughput is bulk results per
second while the urgent requests were being sent, against the capacity the
urgent lane leaves, C x (1 - share). Benchmark code, not part of the package.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from benchmarks.summary import emit
from devkit.apache_kafka import KafkaCluster
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.samples import encode_samples, labelled_samples
from worker.ops.topics import Collector, produce_all

PARTS = 4
# The worker's lanes in a scenario: none (both topics in kafka.input_topics), two
# lanes in one process, or the urgent lane in a process of its own.
Lanes = Literal["off", "shared", "own", "models"]
DEFAULT_SCENARIOS = ("urgent-alone", "lanes", "no-lanes", "lanes-own")


@dataclass
class Scenario:
    name: str
    urgent_sent: int = 0
    urgent_answered: int = 0
    urgent_p50_ms: float = 0.0
    urgent_p99_ms: float = 0.0
    urgent_max_ms: float = 0.0
    # Of it, inside the worker: arrival (intake) to its result encoded (the result's
    # timing_us["total"]); before arrival: produced to taken in (the rest of the
    # latency, but for the result's own send). Until 2026-11-27 "inside" summed
    # every timing_us value, counting queue, preprocess and infer twice (total
    # holds them): the figures recorded before then overstate it.
    urgent_inside_p50_ms: float = 0.0
    urgent_inside_p99_ms: float = 0.0
    urgent_before_p50_ms: float = 0.0
    urgent_before_p99_ms: float = 0.0
    # Inside, by stage, [p50, p99] ms: "queue" arrival to its batch being cut;
    # "engine" the engine thread's timed steps (file decoding, preprocessing,
    # inference, the device-to-host copy; with several groups in one batch, the
    # last group's); "after" the rest until its result is encoded: the engine
    # thread starting the batch (a free slot, the interpreter lock), the other
    # groups' runs, the writer's order, the event loop.
    urgent_stages_ms: dict[str, list[float]] | None = None
    bulk_rate: float = 0.0  # bulk results/s while the urgent lane was sent to
    drain_rate: float = 0.0  # capacity: first to last result
    # The worker's own: arrival to batch, mean per lane (infer_lane_queue_seconds).
    queue_ms: dict[str, float] | None = None
    # How late the worker's event loop ran its 0.1 s timer while the urgent lane
    # was sent (infer_event_loop_lag_seconds): the bucket bound at the 50th and
    # 99th percentile, and the share of ticks more than 10 ms late.
    loop_lag_p50_ms: float = 0.0
    loop_lag_p99_ms: float = 0.0
    loop_lag_over_10ms: float = 0.0


def _stages(timings: Sequence[Mapping[str, int]]) -> dict[str, list[float]]:
    """[p50, p99] ms of each stage of the time inside the worker (``Scenario``)."""

    def ms(key: str) -> np.ndarray:
        return np.array([t.get(key, 0) for t in timings], float) / 1000.0

    queue, total = ms("queue"), ms("total")
    engine = ms("decode") + ms("preprocess") + ms("infer") + ms("d2h")
    stages = {"queue": queue, "engine": engine, "after": total - queue - engine}
    return {k: [round(float(q), 1) for q in np.percentile(v, [50, 99])] for k, v in stages.items()}


def _records(prefix: str, n: int) -> list[tuple[bytes | None, bytes]]:
    samples = labelled_samples(max(1, -(-n // 360)))[:n]
    encoded = encode_samples(samples)
    return [(f"{prefix}{i}".encode(), value) for i, (_, value) in enumerate(encoded)]


def _lanes_env(urgent: str, bulk: str, own: bool, bulk_rate: float) -> dict[str, str]:
    lanes = (
        f'[{{topics = ["{urgent}"], priority = 0, name = "urgent", '
        f"own_process = {str(own).lower()}}}, "
        f'{{topics = ["{bulk}"], priority = 1, name = "bulk", min_share = 0.05, '
        f"max_records_per_s = {float(bulk_rate)!r}}}]"
    )
    return {"INFER_WORKER_KAFKA__LANES": lanes}


async def _topics(bootstrap: str, name: str) -> dict[str, str]:
    t = {k: f"lanes.{name}.{k}" for k in ("urgent", "bulk", "results", "dlq", "load")}
    # Stamped by the broker when appended (Apache Kafka): latency runs from the
    # broker holding the request to it holding the result, without the time a
    # record waits in this process's producer (its loop also reads every result).
    appended = {"message.timestamp.type": "LogAppendTime"}
    await create_topics(
        bootstrap,
        {t["urgent"]: PARTS, t["bulk"]: PARTS, t["results"]: PARTS, t["dlq"]: 1, t["load"]: PARTS},
        {t["urgent"]: appended, t["results"]: appended} if BROKER_STAMPS else {},
    )
    return t


EXTRA_ENV: dict[str, str] = {}  # --env, for every scenario's worker
BROKER_STAMPS: set[str] = set()  # {"yes"} with --broker kafka: topics stamped by the broker


def _start(
    bootstrap: str, t: dict[str, str], name: str, lanes: Lanes, bulk_rate: float
) -> WorkerProcess:
    return spawn_worker(
        bootstrap,
        input_topics=[t["urgent"], t["bulk"]],
        output_topic=t["results"],
        dlq_topic=t["dlq"],
        group_id=f"lanes-{name}",
        extra_env={
            "INFER_WORKER_LOGGING__LEVEL": "warning",
            **EXTRA_ENV,
            **(
                _lanes_env(t["urgent"], t["bulk"], lanes == "own", bulk_rate)
                if lanes in ("shared", "own")
                else {}
            ),
            **({"INFER_WORKER_MODEL__PATH": "builtin:digits",
                "INFER_WORKER_MODELS__BULK__PATH": "builtin:digits",
                "INFER_WORKER_MODELS__BULK__TOPICS": t["bulk"]} if lanes == "models" else {}),
        },
        members=2 if lanes == "own" else 1,
    )


def _start_load(bootstrap: str, t: dict[str, str], rate: float) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "benchmarks.lanes_load", bootstrap, t["load"], t["results"]]
    return subprocess.Popen([*argv, str(rate)])


async def _warm(bootstrap: str, t: dict[str, str], w: WorkerProcess, c: Collector) -> None:
    """A few urgent requests answered before the clock starts (start-up and the
    group join are not latency)."""
    warm = [(f"warm{i}".encode(), v) for i, (_, v) in enumerate(_records("w", 16))]
    await produce_all(bootstrap, t["urgent"], warm, partition_of=lambda i: i % PARTS)
    gone = lambda: w.proc.poll() is not None  # noqa: E731
    await c.collect(lambda c: c.count() >= 16 or gone(), 120)
    if c.count() < 16:
        raise RuntimeError(f"the worker does not answer:\n{w.log_tail()}")


async def run_scenario(
    bootstrap: str,
    name: str,
    backlog: int,
    rate: float,
    seconds: float,
    lanes: Lanes,
    load_rate: float = 0.0,
    bulk_rate: float = 0.0,
) -> Scenario:
    """``load_rate`` > 0: the backlog is not the worker's but ``benchmarks.lanes_load``'s,
    copied to the results topic at that rate while the urgent lane is sent;
    ``bulk_rate`` > 0: the bulk lane's ``max_records_per_s``."""
    t = await _topics(bootstrap, name)
    if backlog:
        await produce_all(bootstrap, t["load" if load_rate > 0 else "bulk"],
                          _records("b", backlog), partition_of=lambda i: i % PARTS)  # fmt: skip
    w = _start(bootstrap, t, name, lanes, bulk_rate)
    c = Collector(bootstrap, [t["results"]])
    await c.start()
    out = Scenario(name)
    load: subprocess.Popen[bytes] | None = None
    try:
        await _warm(bootstrap, t, w, c)
        if load_rate > 0:
            load = _start_load(bootstrap, t, load_rate)
        if rate <= 0:  # capacity: drain the backlog alone
            await c.collect(lambda c: c.count() >= 16 + backlog, 600)
            stamps = sorted(r.timestamp_ms for r in c.records[t["results"]]
                            if (r.record_key or b"").startswith(b"b"))  # fmt: skip
            span = (stamps[-1] - stamps[0]) / 1000.0
            out.drain_rate = round((len(stamps) - 1) / span, 1) if span > 0 else 0.0
            return out
        urgent = _records("u", int(rate * seconds))
        lag_before = _loop_lag(w)
        answered = _Tally(t["results"], b"u")
        collecting = asyncio.create_task(
            c.collect(lambda c: answered(c) >= len(urgent), seconds + 120)
        )
        produced = await produce_all(bootstrap, t["urgent"], urgent,
                                     partition_of=lambda i: i % PARTS, rate=rate)  # fmt: skip
        await collecting
        await c.collect(lambda _: False, 2.0)  # bulk results of the window still on their way
        stamped = {p.key: p.timestamp_ms for p in produced}
        first, last = min(stamped.values()), max(stamped.values())
        bulk_during = sum(1 for r in c.records[t["results"]]
                          if (r.record_key or b"").startswith(b"b")
                          and first <= r.timestamp_ms <= last)  # fmt: skip
        sent_s = (last - first) / 1000.0 or 1.0
        out.queue_ms = _lane_queue_ms(w)
        lag = {le: n - lag_before.get(le, 0.0) for le, n in _loop_lag(w).items()}
        out.loop_lag_p50_ms, out.loop_lag_p99_ms, out.loop_lag_over_10ms = _lag_summary(lag)
        mine = [r for r in c.records[t["results"]] if r.record_key in stamped]
        lat = np.array([r.timestamp_ms - stamped[r.record_key] for r in mine], float)
        inside = np.array([r.result().timing_us["total"] / 1000.0 for r in mine])
        before = lat - inside
        if len(inside):
            i50, i99 = np.percentile(inside, [50, 99])
            out.urgent_inside_p50_ms, out.urgent_inside_p99_ms = round(i50, 1), round(i99, 1)
            b50, b99 = np.percentile(before, [50, 99])
            out.urgent_before_p50_ms, out.urgent_before_p99_ms = round(b50, 1), round(b99, 1)
            out.urgent_stages_ms = _stages([r.result().timing_us for r in mine])
        out.urgent_sent, out.urgent_answered = len(urgent), len(lat)
        if len(lat):
            p50, p99 = np.percentile(lat, [50, 99])
            out.urgent_p50_ms, out.urgent_p99_ms = round(float(p50), 1), round(float(p99), 1)
            out.urgent_max_ms = round(float(lat.max()), 1)
        out.bulk_rate = round(bulk_during / sent_s, 1)
        return out
    finally:
        if load is not None:
            load.kill()
            load.wait()
        w.kill()
        await c.stop()


def _lane_queue_ms(w: WorkerProcess) -> dict[str, float]:
    m = w.metrics()
    out = {}
    for key, total in m.items():
        if key.startswith("infer_lane_queue_seconds_sum"):
            count = m[key.replace("_sum", "_count")]
            out[key.split('"')[1]] = round(1000 * total / count, 2) if count else 0.0
    return out


def _loop_lag(w: WorkerProcess) -> dict[float, float]:
    """The event-loop lag histogram's cumulative counts, by bucket bound."""
    prefix = 'infer_event_loop_lag_seconds_bucket{le="'
    return {float(k[len(prefix):].split('"')[0]): v
            for k, v in w.metrics().items() if k.startswith(prefix)}  # fmt: skip


def _lag_summary(cumulative: dict[float, float]) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, share more than 10 ms late) from cumulative bucket counts
    (a percentile is its bucket's upper bound)."""
    bounds = sorted(cumulative)
    total = cumulative.get(float("inf"), 0.0)
    if not total:
        return 0.0, 0.0, 0.0

    def at(q: float) -> float:
        bound = next(b for b in bounds if cumulative[b] >= q * total)
        return round(1000 * bound, 1) if bound != float("inf") else float("inf")

    within_10 = cumulative.get(0.01, 0.0)  # ticks at most 10 ms late
    return at(0.5), at(0.99), round(1 - within_10 / total, 3)


class _Tally:
    """How many of a topic's collected records have keys starting with ``prefix``,
    counted incrementally: the collector asks after every fetch, and a recount of
    the whole list each time (up to 100,000 bulk results) took this process from
    a third of a core to two thirds as the list grew, from the worker and the
    broker it measures on a 2-core host."""

    def __init__(self, topic: str, prefix: bytes) -> None:
        self._topic, self._prefix = topic, prefix
        self._seen = self._count = 0

    def __call__(self, c: Collector) -> int:
        records = c.records[self._topic]  # only ever appended to
        for r in records[self._seen :]:
            self._count += (r.record_key or b"").startswith(self._prefix)
        self._seen = len(records)
        return self._count


async def run(args: argparse.Namespace) -> dict[str, object]:
    results: list[Scenario] = []
    with EmbeddedBroker() if args.broker == "embedded" else KafkaCluster(1) as broker:
        bs = broker.bootstrap
        if args.capacity > 0:
            cap = Scenario("capacity (given)", drain_rate=args.capacity)
        else:
            cap = await run_scenario(bs, "capacity", args.backlog, 0.0, 0.0, lanes="shared")
        results.append(cap)
        rate = args.share * cap.drain_rate
        load_rate = args.load_rate or cap.drain_rate * (1 - args.share)
        bulk_cap = args.bulk_cap * cap.drain_rate * (1 - args.share)
        print(f"  capacity {cap.drain_rate:,.0f} rec/s; urgent at {rate:,.0f}/s", file=sys.stderr)
        for i in range(args.repeat):
            order: list[tuple[str, int, Lanes, float, float]] = [
                ("urgent-alone", 0, "shared", 0.0, 0.0),
                ("lanes", args.backlog, "shared", 0.0, 0.0),
                ("no-lanes", args.backlog, "off", 0.0, 0.0),
                ("lanes-own", args.backlog, "own", 0.0, 0.0),
                ("lanes-cap", args.backlog, "shared", 0.0, bulk_cap),
                ("lanes-own-cap", args.backlog, "own", 0.0, bulk_cap),
                ("models-alone", 0, "models", 0.0, 0.0),
                ("models", args.backlog, "models", 0.0, 0.0),
                ("urgent-loaded", args.backlog, "shared", load_rate, 0.0)]  # fmt: skip
            order = [o for o in order if o[0] in (args.only or DEFAULT_SCENARIOS)]
            for name, backlog, lanes, load, bulk_rate in order if i % 2 == 0 else order[::-1]:
                s = await run_scenario(bs, f"{name}-{i}", backlog, rate, args.seconds, lanes,
                                       load, bulk_rate)  # fmt: skip
                s.name = name
                results.append(s)
                print(f"  {name:13s} urgent p50 {s.urgent_p50_ms:7.1f} p99 {s.urgent_p99_ms:7.1f} "
                      f"max {s.urgent_max_ms:7.1f} ms ({s.urgent_answered}/{s.urgent_sent}); "
                      f"(inside the worker p50 {s.urgent_inside_p50_ms} p99 "
                      f"{s.urgent_inside_p99_ms}; before arrival p50 {s.urgent_before_p50_ms} "
                      f"p99 {s.urgent_before_p99_ms}; stages [p50, p99] {s.urgent_stages_ms}); "
                      f"bulk {s.bulk_rate:,.0f} rec/s; queue ms {s.queue_ms}; loop lag p50 "
                      f"{s.loop_lag_p50_ms} p99 {s.loop_lag_p99_ms} ms", file=sys.stderr,
                      flush=True)  # fmt: skip
    return {"broker": args.broker, "backlog": args.backlog, "share": args.share,
            "worker_env": args.env,
            "seconds": args.seconds, "capacity_rec_s": cap.drain_rate, "urgent_rate": rate,
            "bulk_cap_rec_s": round(args.bulk_cap * cap.drain_rate * (1 - args.share), 1),
            "bulk_target_rec_s": round(0.85 * cap.drain_rate * (1 - args.share), 1),
            "results": [asdict(r) for r in results]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=("embedded", "kafka"), default="kafka")
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--share", type=float, default=0.2, help="urgent rate / capacity")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--only",
        nargs="*",
        help="scenarios to run after the capacity one: "
        f"{', '.join(DEFAULT_SCENARIOS)} (the default), lanes-cap, lanes-own-cap, "
        "models-alone, models and urgent-loaded",
    )
    parser.add_argument("--env", action="append", default=[], metavar="INFER_WORKER_X=V",
                        help="worker environment for every scenario")  # fmt: skip
    parser.add_argument("--capacity", type=float, default=0.0, metavar="REC_S",
                        help="take this capacity instead of measuring it (A/B runs of "
                             "two commits at one urgent rate)")  # fmt: skip
    parser.add_argument("--load-rate", type=float, default=0.0, metavar="REC_S",
                        help="urgent-loaded: the copier's rate (default: the capacity "
                             "the urgent lane leaves)")  # fmt: skip
    parser.add_argument("--bulk-cap", type=float, default=0.95, metavar="F",
                        help="lanes-cap, lanes-own-cap: the bulk lane's max_records_per_s, as "
                             "this share of the capacity the urgent lane leaves")  # fmt: skip
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    EXTRA_ENV.update(item.split("=", 1) for item in args.env)
    if args.broker == "kafka":
        BROKER_STAMPS.add("yes")
    with children_die_with_this_process("benchmarks.lanes"):
        summary = asyncio.run(run(args))
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
