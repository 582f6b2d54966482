"""A pipeline in one worker against the same steps as two workers chained by a
topic with a glue consumer between them, what a user does today (issue 59).

    .venv/bin/python -m benchmarks.pipeline --broker kafka --requests 2000 \\
        --rate 100 --seconds 20 [--repeat 2] [--json out.json]

The steps: openWakeWord's melspectrogram model, the window between
(``tests.pipeline_functions.mel_window``), openWakeWord's embedding model, on
one second of 16 kHz audio per request (64 kB). Two setups, each on fresh
topics and groups, alternating when repeated:

- ``pipeline``: one worker, ``[pipelines.wakeword]`` (as tests/integration/
  test_pipelines.py configures it);
- ``chained``: a worker serving the melspectrogram model, whose results the glue
  (``benchmarks.pipeline_glue``, aiokafka) turns into requests for a second
  worker serving the embedding model.

Each setup: ``drain`` (``--requests`` sent as a backlog before the processes
start; final answers per second, first to last), then ``paced`` (open-loop
Poisson at ``--rate`` for ``--seconds``: end-to-end p50/p99, the final answer's
broker timestamp minus the request's). Benchmark code, not shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.summary import emit
from devkit.apache_kafka import KafkaCluster
from tests import real_models
from tests.wakeword import wakeword_toml
from worker.contract import Request, Tensor, encode_request
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import Collector, produce_all

PARTS = 4
SAMPLES = 16000
STAMPED = {"message.timestamp.type": "LogAppendTime"}
QUIET = {"INFER_WORKER_LOGGING__LEVEL": "warning"}


def _requests(prefix: str, n: int) -> list[tuple[bytes | None, bytes]]:
    rng = np.random.default_rng(59)
    clips = [rng.normal(0, 3000, SAMPLES).astype(np.float32) for _ in range(16)]
    return [(f"{prefix}{i}".encode(), encode_request(Request(
        v=1, id=f"{prefix}{i}", inputs={"input": Tensor.from_numpy(clips[i % 16])})))
        for i in range(n)]  # fmt: skip


class Setup:
    """One setup's processes on fresh topics: ``start`` them, ``stop`` them."""

    def __init__(self, kind: str, bootstrap: str, tag: str, config_dir: Path) -> None:
        self.kind, self.bootstrap, self.tag = kind, bootstrap, tag
        self.t = {k: f"pipe.{tag}.{k}" for k in ("requests", "mid", "next", "results", "dlq")}
        self.config = config_dir / f"{tag}.toml"
        self.procs: list[WorkerProcess] = []
        self.glue: subprocess.Popen[bytes] | None = None

    async def topics(self) -> None:
        t = self.t
        await create_topics(self.bootstrap, {t[k]: PARTS for k in ("requests", "mid", "next",
                                                                 "results")} | {t["dlq"]: 1},
                            {t["requests"]: STAMPED, t["results"]: STAMPED})  # fmt: skip

    def start(self) -> None:
        t, bs = self.t, self.bootstrap
        if self.kind == "pipeline":
            self.config.write_text(wakeword_toml(t["requests"]))
            self.procs = [spawn_worker(bs, input_topics=[t["requests"]], output_topic=t["results"],
                                       dlq_topic=t["dlq"], group_id=f"pipe-{self.tag}",
                                       command=("run", "--config", str(self.config)),
                                       extra_env=QUIET)]  # fmt: skip
            return
        melspec = real_models.model_path("oww-melspectrogram")
        embedding = real_models.model_path("oww-embedding")
        first = spawn_worker(bs, input_topics=[t["requests"]], output_topic=t["mid"],
                             dlq_topic=t["dlq"], group_id=f"pipe-{self.tag}-1",
                             extra_env={**QUIET, "INFER_WORKER_MODEL__PATH": str(melspec)})
        second = spawn_worker(bs, input_topics=[t["next"]], output_topic=t["results"],
                              dlq_topic=t["dlq"], group_id=f"pipe-{self.tag}-2",
                              extra_env={**QUIET, "INFER_WORKER_MODEL__PATH": str(embedding)})
        self.procs = [first, second]
        self.glue = subprocess.Popen([sys.executable, "-m", "benchmarks.pipeline_glue", bs,
                                      t["mid"], t["next"], f"glue-{self.tag}"])  # fmt: skip

    def stop(self) -> None:
        if self.glue is not None:
            self.glue.kill()
            self.glue.wait()
        for p in self.procs:
            p.terminate()


async def drain(bootstrap: str, kind: str, n: int, config_dir: Path) -> dict[str, Any]:
    s = Setup(kind, bootstrap, f"{kind}-drain-{uuid.uuid4().hex[:6]}", config_dir)
    await s.topics()
    await produce_all(bootstrap, s.t["requests"], _requests("d", n),
                      partition_of=lambda i: i % PARTS)  # fmt: skip
    c = Collector(bootstrap, [s.t["results"]])
    await c.start()
    s.start()
    try:
        done = await c.collect(lambda c: c.count() >= n, 600.0)
    finally:
        s.stop()
        await c.stop()
    got = c.records[s.t["results"]]
    assert done, f"{kind}: {len(got)} of {n} answered"
    ok = sum(r.result().status == "ok" for r in got)
    # First to last answer, by the results' timestamps (the broker's with --broker kafka).
    seconds = max(1, max(r.timestamp_ms for r in got) - min(r.timestamp_ms for r in got)) / 1e3
    return {"setup": kind, "requests": n, "ok": ok, "answers_per_s": round(n / seconds, 1)}


async def paced(bootstrap: str, kind: str, rate: float, seconds: float,
                config_dir: Path) -> dict[str, Any]:  # fmt: skip
    s = Setup(kind, bootstrap, f"{kind}-paced-{uuid.uuid4().hex[:6]}", config_dir)
    await s.topics()
    c = Collector(bootstrap, [s.t["results"]])
    await c.start()
    s.start()
    try:
        warm = _requests("w", 16)  # start-up and the group joins are not latency
        await produce_all(bootstrap, s.t["requests"], warm, partition_of=lambda i: i % PARTS)
        assert await c.collect(lambda c: c.count() >= 16, 180.0), f"{kind} does not answer"
        n = int(rate * seconds)
        sent = await produce_all(bootstrap, s.t["requests"], _requests("p", n), rate=rate,
                                 partition_of=lambda i: i % PARTS)  # fmt: skip
        assert await c.collect(lambda c: c.count() >= 16 + n, 300.0), f"{kind}: not all answered"
    finally:
        s.stop()
        await c.stop()
    stamp = {p.key: p.timestamp_ms for p in sent}
    ms = np.array([r.timestamp_ms - stamp[r.record_key] for r in c.records[s.t["results"]]
                   if r.record_key in stamp], float)  # fmt: skip
    return {"setup": kind, "rate": rate, "answered": int(ms.size),
            "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1)}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    with (EmbeddedBroker() if args.broker == "embedded" else KafkaCluster(1) as broker,
          tempfile.TemporaryDirectory() as tmp):  # fmt: skip
        for i in range(args.repeat):
            kinds = ("pipeline", "chained") if i % 2 == 0 else ("chained", "pipeline")
            for kind in kinds:
                for result in (await drain(broker.bootstrap, kind, args.requests, Path(tmp)),
                               await paced(broker.bootstrap, kind, args.rate, args.seconds,
                                           Path(tmp))):  # fmt: skip
                    print(f"  {result}", file=sys.stderr, flush=True)
                    out.append(result)
    return {"broker": args.broker, "requests": args.requests, "rate": args.rate,
            "seconds": args.seconds, "samples_per_request": SAMPLES, "results": out}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=("embedded", "kafka"), default="kafka")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    with children_die_with_this_process("benchmarks.pipeline"):
        summary = asyncio.run(run(args))
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
