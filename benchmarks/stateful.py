"""Stateful models per Kafka key (issue 28): throughput by number of streams, and
restore time.

    .venv/bin/python -m benchmarks.stateful [--records 20000] [--streams 1,100,10000]
        [--restore 100000] [--json out.json]

silero-vad (the real voice-activity detector of tests/real_models.py, 512-sample
chunks) on the embedded broker, at-least-once, one worker process. For each
number of concurrent streams (record keys), the same backlog is drained by:

* ``stateless``: the model served as it is, each request carrying its own state
  (what a client had to do before issue 28; batches are unconstrained);
* ``memory``: ``[model.state.state]``, states kept by the worker, in memory;
* ``changelog``: the same with ``kafka.state_topic`` (each answer's state also
  written to the changelog, acknowledged before its offset counts as done).

A stream's chunks run one per engine run (a batch holds one request per
sequence), so with few streams batches are small: the figures show what that
costs. Then ``--restore`` states are written to a one-partition changelog and
read back as a worker restores them on assignment (``worker.kafka.changelog``).
Benchmark code: not part of the installed package.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from benchmarks.drain import drain_worker
from benchmarks.summary import emit
from tests import real_models
from worker.config import KafkaConfig
from worker.contract import Request, Tensor, encode_request
from worker.flow.messages import Job, StateChange, TopicPartition
from worker.kafka.changelog import encode_state, restore
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.topics import produce_all

SAMPLES = 512
STATELESS = {"INFER_WORKER_MODEL__INPUTS__SR__VALUE": "16000"}
STATEFUL = {**STATELESS, "INFER_WORKER_MODEL__STATE__STATE__OUTPUT": "stateN"}


def backlog(records: int, streams: int, with_state: bool) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(streams)
    chunk = rng.normal(0, 0.1, (64, SAMPLES)).astype(np.float32)
    state = np.zeros((2, 128), np.float32)
    out = []
    for i in range(records):
        s = i % streams
        inputs = {"input": Tensor.from_numpy(chunk[i % 64])}
        if with_state:
            inputs["state"] = Tensor.from_numpy(state)
        out.append(
            (f"stream-{s}".encode(), encode_request(Request(v=1, id=f"r{i}", inputs=inputs)))
        )
    return out


async def drains(args: argparse.Namespace, broker: EmbeddedBroker) -> list[dict[str, object]]:
    model = str(real_models.model_path("silero-vad"))
    rows = []
    for streams in args.streams:
        row: dict[str, object] = {"streams": streams, "records": args.records}
        for name in ("stateless", "memory", "changelog"):
            prefix = f"st.{streams}.{name}"
            topics = {k: f"{prefix}.{k}" for k in ("requests", "results", "dlq")}
            parts = args.partitions
            await create_topics(broker.bootstrap, {
                topics["requests"]: parts, topics["results"]: parts, topics["dlq"]: 1,
                f"{prefix}.states": parts,
            })  # fmt: skip
            records = backlog(args.records, streams, with_state=name == "stateless")
            await produce_all(broker.bootstrap, topics["requests"], records,
                              partition_of=lambda i, k=streams, p=parts: (i % k) % p)  # fmt: skip
            env = {"INFER_WORKER_MODEL__PATH": model, **STATELESS}
            if name != "stateless":
                env |= STATEFUL
            if name == "changelog":
                env["INFER_WORKER_KAFKA__STATE_TOPIC"] = f"{prefix}.states"
            d = await drain_worker(broker.bootstrap, topics, len(records), f"{prefix}.g", env)
            row[f"{name}_rec_s"] = round(d.rate)
            row[f"{name}_mean_batch"] = round(d.mean_batch, 1)
            print(f"  {streams:6d} streams {name:9s} {d.rate:9,.0f} rec/s (mean batch "
                  f"{d.mean_batch:.1f})", file=sys.stderr, flush=True)  # fmt: skip
        row["ratio_memory_to_stateless"] = round(
            float(row["memory_rec_s"]) / float(row["stateless_rec_s"]),
            2,  # type: ignore[arg-type]
        )
        row["ratio_changelog_to_memory"] = round(
            float(row["changelog_rec_s"]) / float(row["memory_rec_s"]),
            2,  # type: ignore[arg-type]
        )
        rows.append(row)
    return rows


async def restore_time(broker: EmbeddedBroker, n: int) -> dict[str, object]:
    topic = "st.restore.states"
    await create_topics(broker.bootstrap, {topic: 1})
    state = StateChange(
        {"state": np.random.default_rng(0).normal(size=(2, 128)).astype(np.float32)}
    )
    job = Job(TopicPartition("in", 0), 0, None, 0.0, None)
    value = encode_state(job, state) or b""
    await produce_all(broker.bootstrap, topic, ((f"s{i}".encode(), value) for i in range(n)))
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap, state_topic=topic)
    t0 = time.monotonic()
    states = await restore(kafka, [0], ttl_s=3600.0, read_committed=False)
    seconds = time.monotonic() - t0
    assert len(states[0]) == n, len(states[0])
    print(f"  restore {n:,} states ({len(value)} B each): {seconds:.2f} s", file=sys.stderr)
    return {"states": n, "record_bytes": len(value), "seconds": round(seconds, 2),
            "states_per_s": round(n / seconds)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, object]:
    with EmbeddedBroker() as broker:
        rows = await drains(args, broker)
        restored = await restore_time(broker, args.restore) if args.restore else {}
    return {"broker": "embedded", "partitions": args.partitions, "drains": rows,
            "restore": restored}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--streams", type=lambda t: [int(v) for v in t.split(",")],
                        default=[1, 100, 10_000])  # fmt: skip
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--restore", type=int, default=100_000, help="states to restore (0: skip)")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.stateful"):
        summary = asyncio.run(run(args))
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
