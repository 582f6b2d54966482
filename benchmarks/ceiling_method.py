"""The ingest ceiling, timed two ways on the same backlog, alternating.

    git show 35c236e:worker/bench/ceiling.py > /tmp/old_drain.py
    .venv/bin/python -m benchmarks.ceiling_method /tmp/old_drain.py --records 30000 --repeat 4

``old``: ``drain_ceiling`` from the given file (before 2026-11-23's change: a
consumer group, the clock started when the first fetch returned, every record
counted, including those the first fetch brought in before the clock ran).
``new``: today's ``worker.bench.ceiling.drain_ceiling`` (assigned partitions, the
clock started before the first fetch). Benchmark code: not shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys

from worker.bench.ceiling import drain_ceiling
from worker.bench.demo import encode_samples, labelled_samples
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.topics import produce_all


async def run(args: argparse.Namespace) -> dict[str, object]:
    spec = importlib.util.spec_from_file_location("old_drain", args.old)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_drain"] = old  # dataclasses look their module up there
    spec.loader.exec_module(old)
    records = encode_samples(labelled_samples(-(-args.records // 360))[: args.records])
    rates: dict[str, list[int]] = {"old": [], "new": []}
    with EmbeddedBroker() as broker:
        await create_topics(broker.bootstrap, {"ceiling": args.partitions})
        await produce_all(
            broker.bootstrap, "ceiling", records, partition_of=lambda i: i % args.partitions
        )
        for i in range(args.repeat):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                if name == "old":
                    d = await old.drain_ceiling(broker.bootstrap, "ceiling", len(records), f"g{i}")
                else:
                    d = await drain_ceiling(broker.bootstrap, "ceiling", len(records))
                rates[name].append(round(d.rate))
    return {
        "records": len(records),
        "partitions": args.partitions,
        "rec_s": rates,
        "old_over_new_median": round(
            statistics.median(o / n for o, n in zip(rates["old"], rates["new"], strict=True)), 2
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="a drain.py with the previous drain_ceiling")
    p.add_argument("--records", type=int, default=30000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--repeat", type=int, default=4)
    with children_die_with_this_process("benchmarks.ceiling_method"):
        summary = asyncio.run(run(p.parse_args()))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
