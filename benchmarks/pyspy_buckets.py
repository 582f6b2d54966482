"""Group a py-spy profile's event-loop samples into the per-record buckets of issue 36.

    .venv/bin/python -m benchmarks.pyspy_buckets before.txt after.txt [--json out.json]

Reads ``py-spy record --format raw`` files (collapsed stacks) of worker processes
(``benchmarks/results/2026-11-26-pyspy-drain.sh`` makes them during a drain),
keeps the samples of the thread running the event loop, and puts each in the
first bucket one of whose markers its stack holds. Prints a Markdown table of
each bucket's share of the loop's samples. Benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Iterator

BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("decode (decode_request)", ("decode_request",)),
    ("intake, the rest (JobFactory, input check, Job)", ("JobFactory.__call__",)),
    ("consume: aiokafka fetch and records", ("AIOKafkaConsumer.getmany", "Fetcher.")),
    ("batching", ("MicroBatcher", "batching.py")),
    ("inference call from the loop (triage, scatter)",
     ("CpuStage", "GpuStage", "InferenceStage", "triage")),  # InferenceStage: older profiles
    ("encode results (record_for)", ("record_for",)),
    ("send (send_grouped, aiokafka's producer)",
     ("send_grouped", "Sender.", "SendProduceReqHandler", "MessageAccumulator",
      "AIOKafkaProducer")),
    ("acknowledge", ("_acknowledged", "_await_acks")),
    ("commit", ("Committer", "_do_commit_offsets", "GroupCoordinator.commit")),
    ("socket reads (responses)", ("_read_ready", "AIOKafkaConnection._read", "readexactly")),
    ("select", ("EpollSelector.select",)),
)  # fmt: skip


def stacks(path: str) -> Iterator[tuple[str, int]]:
    with open(path) as fh:
        for line in fh:
            stack, count = line.rstrip().rsplit(" ", 1)
            yield stack, int(count)


def shares(path: str) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for stack, n in stacks(path):
        if "_run_once" not in stack:  # another thread than the event loop's
            continue
        total += n
        bucket = next((name for name, keys in BUCKETS if any(k in stack for k in keys)), "other")
        counts[bucket] += n
    out = {name: round(100 * counts[name] / total, 1) for name, _ in BUCKETS}
    out["other"] = round(100 * counts["other"] / total, 1)
    out["loop_samples"] = total
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--json")
    args = parser.parse_args()
    table = {path: shares(path) for path in args.profiles}
    print("| bucket | " + " | ".join(args.profiles) + " |")
    print("|---" * (len(args.profiles) + 1) + "|")
    for name in [*(n for n, _ in BUCKETS), "other", "loop_samples"]:
        print(f"| {name} | " + " | ".join(str(table[p][name]) for p in args.profiles) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(table, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
