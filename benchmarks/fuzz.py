"""Fuzzing at scale: mutated requests through a real worker (issue 10).

    .venv/bin/python benchmarks/fuzz.py --payloads 100000 [--seed 1] [--json out.json]

Valid requests (uint8 tensors, JPEG and PNG files, with and without meta and
deadlines) are mutated by a seeded byte mutator, either the whole msgpack record
(flips, inserted and deleted runs, truncation, msgpack type bytes) or only the
image file inside a still-valid envelope (so the image decoders see hostile
bytes). All of them go through the embedded broker to one ``infer-worker run``;
every one must be answered (a result or a DLQ record) by the same process, which
must not crash. Reports the answer classes, the worker's peak RSS and the rate.
``tests/faults/test_fuzz.py`` runs a small seeded corpus of the same in CI.
Benchmark code: not part of the installed package.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
from PIL import Image

from worker.contract import decode_result
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import spawn_worker
from worker.ops.topics import Collector, produce_all

_INTERESTING = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC4, 0xD9, 0xDC, 0xDE, 0xDF, 0x90)


def _image_file(rng: random.Random, fmt: str) -> bytes:
    side = rng.choice((8, 16, 24, 40))
    pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (side, side), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _valid(rng: random.Random, i: int) -> tuple[dict[str, object], str]:
    """A valid request map, and which input form it has."""
    form = rng.choice(("tensor", "jpeg", "png"))
    if form == "tensor":
        side = rng.choice((8, 16, 24))
        data = bytes(rng.randrange(256) for _ in range(side * side))
        image: object = {"dtype": "uint8", "shape": [side, side, 1], "data": data}
    else:
        image = _image_file(rng, "JPEG" if form == "jpeg" else "PNG")
    request: dict[str, object] = {"v": 1, "id": f"fuzz-{i}", "inputs": {"image": image}}
    if rng.random() < 0.3:
        request["meta"] = {"n": i, "tag": "x" * rng.randrange(8)}
    if rng.random() < 0.2:
        request["deadline_ms"] = int(time.time() * 1000) + rng.randrange(-5_000, 60_000)
    return request, form


def mutate_bytes(rng: random.Random, data: bytes, rounds: int) -> bytes:
    buf = bytearray(data)
    for _ in range(rounds):
        if not buf:
            buf.extend(rng.randbytes(rng.randrange(1, 8)))
            continue
        pos = rng.randrange(len(buf))
        op = rng.randrange(6)
        if op == 0:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[pos] = rng.choice(_INTERESTING)
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randrange(1, 16))
        elif op == 3:
            del buf[pos : pos + rng.randrange(1, 32)]
        elif op == 4:
            del buf[pos:]
        else:
            end = min(len(buf), pos + rng.randrange(1, 64))
            buf[pos:pos] = buf[pos:end]
    return bytes(buf)


def corpus(n: int, seed: int) -> tuple[list[tuple[bytes | None, bytes]], Counter[str]]:
    """``n`` payloads: a tenth left valid, the rest mutated; the kinds made."""
    rng = random.Random(seed)
    out: list[tuple[bytes | None, bytes]] = []
    kinds: Counter[str] = Counter()
    for i in range(n):
        request, form = _valid(rng, i)
        roll = rng.random()
        inputs = request["inputs"]
        assert isinstance(inputs, dict)
        if roll < 0.1:
            kind = f"valid {form}"
        elif roll < 0.45 and form != "tensor":
            inputs["image"] = mutate_bytes(rng, inputs["image"], rng.randrange(1, 6))
            kind = f"mutated {form} file"
        else:
            kind = "mutated record"
        value = msgpack.packb(request, use_bin_type=True)
        if kind == "mutated record":
            value = mutate_bytes(rng, value, rng.randrange(1, 6))
        kinds[kind] += 1
        out.append((f"k{i}".encode(), value))
    return out, kinds


@dataclass
class Outcome:
    sent: int
    answered: int
    classes: dict[str, int]
    kinds: dict[str, int]
    worker_exit_during_run: int | None
    peak_rss_mib: float
    seconds: float


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def run(n: int, seed: int, partitions: int = 2, timeout: float = 900.0) -> Outcome:
    records, kinds = corpus(n, seed)
    names = {"requests": "fuzz.requests", "results": "fuzz.results", "dlq": "fuzz.dlq"}
    with EmbeddedBroker() as broker:
        await create_topics(
            broker.bootstrap, {names["requests"]: partitions, names["results"]: 1, names["dlq"]: 1}
        )
        worker = spawn_worker(
            broker.bootstrap,
            input_topics=[names["requests"]],
            output_topic=names["results"],
            dlq_topic=names["dlq"],
            group_id="fuzz",
            # Hostile input is the point here: the failure budget would halt the
            # worker on purpose once most records fail.
            extra_env={
                "INFER_WORKER_DLQ__MAX_CONSECUTIVE": "0",
                "INFER_WORKER_DLQ__MAX_RATIO": "1.0",
                "INFER_WORKER_LOGGING__LEVEL": "error",
            },
        )
        collector = Collector(broker.bootstrap, [names["results"], names["dlq"]])
        started = time.monotonic()
        try:
            await collector.start()
            collecting = asyncio.create_task(collector.collect(lambda c: c.count() >= n, timeout))
            await produce_all(broker.bootstrap, names["requests"], records)
            await collecting
            seconds = time.monotonic() - started
            exit_during_run = worker.proc.poll()
            peak = _peak_rss_mib(worker.pid) if exit_during_run is None else float("nan")
        finally:
            worker.terminate()
            await collector.stop()
    classes: Counter[str] = Counter()
    for rec in collector.records[names["results"]]:
        res = decode_result(rec.value)
        classes["ok" if res.error is None else f"error {res.error.code}"] += 1
    for rec in collector.records[names["dlq"]]:
        classes[f"dlq {rec.headers.get('error.code', b'?').decode()}"] += 1
    return Outcome(n, collector.count(), dict(classes), dict(kinds), exit_during_run,
                   round(peak, 1), round(seconds, 2))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--payloads", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the outcome here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.fuzz"):
        outcome = asyncio.run(run(args.payloads, args.seed))
    doc = vars(outcome)
    print(json.dumps(doc, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    ok = outcome.answered >= outcome.sent and outcome.worker_exit_during_run is None
    print("fuzz: OK" if ok else "fuzz: FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
