"""Backlog drain on the CPU: the worker against the ingest ceiling, same run.

    .venv/bin/python -m benchmarks.drain --records 30000 [--repeat 3] [--peers ...]
        [--json out.json]
    .venv/bin/python -m benchmarks.drain --payload text|tensor --peers   # the other input kinds
    .venv/bin/python -m benchmarks.drain --payload tensor --avro   # Avro beside msgpack

Starts the embedded broker, produces a backlog over ``--partitions`` and drains
the same records several times, one after the other, on the same machine. The
backlog (``--payload``): ``digits`` (default), the bundled model's digit
requests (8x8, 16x16 and 24x24, as the demo sends them); ``text``, the bundled
text model's held-out reviews (the worker tokenizes them; 7 to 40 tokens);
``tensor``, a two-input ranker (features float32 [4] and ids int64 [1..128],
lengths uniform) written by tests/onnx_models.py. For text and tensor the
worker's padding is reported (padding / data elements, from
``infer_padded_elements_total``), and ``--env
INFER_WORKER_BATCHING__SPLIT_BY_LENGTH=false`` gives the unsplit figure. Drains:

* ``ceiling``: a bare aiokafka consumer that decodes each value with msgpack and
  discards it. No processor can beat it: it is the rate Kafka and the client
  library deliver records to Python at all.
* ``worker``: one ``infer-worker run`` process in a fresh group; the rate is
  counted from its first result to its last (start-up and model loading are
  not part of a drain), and every request must be answered ``ok``.
* a ``--variant NAME:INFER_WORKER_X=V,...``: the worker again with other
  settings, e.g. exactly-once against at-least-once (with ``--broker kafka``:
  ``--variant eos:INFER_WORKER_KAFKA__PROCESSING_GUARANTEE=exactly-once,``
  ``INFER_WORKER_KAFKA__GROUP_INSTANCE_ID=drain``).
* ``baseline`` (with ``--baseline-path DIR``): the same, but the worker process
  runs the ``worker`` package found in DIR (e.g. a ``git worktree`` of an older
  commit), so two versions are compared on the same backlog in the same run.

Each drain reports its processor's CPU per record and, over the same window,
the whole machine's and its busy share (``benchmarks/cpu.py``): the machine's minus
the processor's is what the broker and the bench spent on each record, and a
machine near 100% busy bounds the rate whatever the processor spends.

The ratio worker / ceiling is what issue 11 measures (target >= 0.1 on 2 cores).
Benchmark code: not part of the installed package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from benchmarks.backlogs import avro_backlog, avro_status, otlp_sink, payload
from benchmarks.cpu import CpuWindow
from benchmarks.peers import NAMES as PEERS
from benchmarks.peers import argv as peer_argv
from benchmarks.peers import package_argv
from devkit.apache_kafka import KafkaCluster
from devkit.kafka_security import grant_everything, listener_variants, secured_cluster
from devkit.schema_registry import SchemaRegistryServer
from worker.bench.ceiling import Drain, arrivals_after, drain_ceiling
from worker.contract import decode_request
from worker.contract.oip_client import encode_oip_request
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import mean_batch_size, spawn_worker, summed
from worker.ops.topics import Collector, produce_all

_BENCH_PASSWORD = "bench-only-password"


async def drain_worker(
    bootstrap: str,
    topics: dict[str, str],
    n: int,
    group: str,
    extra_env: dict[str, str],
    package_dir: str | None = None,
    procs: int = 1,
    peer: str | None = None,
    isolation_level: str = "read_uncommitted",
    status: Callable[[bytes], str] | None = None,
) -> Drain:
    """``status``: reads a result's status (default: a msgpack or JSON result's)."""
    collector = Collector(bootstrap, [topics["results"]], isolation_level=isolation_level)
    await collector.start()
    worker = spawn_worker(
        bootstrap,
        input_topics=[topics["requests"]],
        output_topic=topics["results"],
        dlq_topic=topics["dlq"],
        group_id=group,
        extra_env={"INFER_WORKER_LOGGING__LEVEL": "warning", **extra_env},
        argv=(
            peer_argv(peer) if peer else None if package_dir is None else package_argv(package_dir)
        ),
        command=("run", "--procs", str(procs)),
    )
    cpu = CpuWindow(worker.proc.pid)

    def done(c: Collector) -> bool:
        cpu.sample(c.count(), final=c.count() >= n)
        return c.count() >= n or worker.proc.poll() is not None

    try:
        # Stop waiting as soon as the process is gone: its log says why.
        await collector.collect(done, 600.0)
        if collector.count() < n:
            raise RuntimeError(f"worker answered {collector.count()} of {n}:\n{worker.log_tail()}")
        m = {} if peer else summed(worker.member_metrics(procs))
        exit_code = await asyncio.to_thread(worker.terminate)
        if peer:
            exit_code = 0  # peers stop on SIGTERM without a drain protocol
    finally:
        worker.kill()
        await collector.stop()
    results = collector.records[topics["results"]]
    bad = [r for r in results
           if (status(r.value) if status else r.result().status) != "ok"]  # fmt: skip
    if bad or exit_code != 0:
        raise RuntimeError(f"{len(bad)} results not ok, worker exit {exit_code}")
    times = [r.received_at for r in results]
    first, last = times[0], times[-1]
    data = m.get('infer_padded_elements_total{kind="data"}', 0.0)
    padding = m.get('infer_padded_elements_total{kind="padding"}', 0.0) / data if data else 0.0
    drain = Drain("worker", arrivals_after(times, first), last - first, mean_batch_size(m), padding)
    drain.cpu_us_per_record = round(cpu.us_per_record(), 1)
    drain.host_us_per_record = round(cpu.host_us_per_record(), 1)
    drain.host_busy = round(cpu.host_busy(), 3)
    return drain


def cpu_ratios(runs: dict[str, list[Drain]]) -> dict[str, float]:
    """Each processor's CPU per record over the worker's, the median of the rounds
    (above 1: it spends more per record than the worker)."""
    out = {}
    for name, drains in runs.items():
        pairs = [(d.cpu_us_per_record, w.cpu_us_per_record)
                 for d, w in zip(drains, runs["worker"], strict=True)]  # fmt: skip
        ratios = [d / w for d, w in pairs if d and w]
        if name not in ("ceiling", "worker") and ratios:
            out[name] = round(statistics.median(ratios), 2)
    return out


async def run(args: argparse.Namespace) -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(prefix="drain-"))
    records, payload_env = payload(args.payload, args.records, tmp, args.tensor_lengths)
    baseline_path = args.baseline_path  # made absolute in main()
    names = ["ceiling", "worker"] + (["baseline"] if args.baseline_path else [])
    names += list(args.peers)
    # --variant NAME:KEY=VALUE,...: the worker again with other settings, same run.
    variants = {
        name: dict(item.split("=", 1) for item in settings.split(","))
        for name, settings in (v.split(":", 1) for v in args.variant)
    }
    secured = (
        secured_cluster(tmp / "pki", _BENCH_PASSWORD) if args.broker == "kafka-secured" else None
    )
    if secured:
        variants |= {"sasl_ssl": {}, "mtls": {}}  # settings once the cluster listens
    names += list(variants)
    if args.oip:
        names.append("worker-oip")
    if args.avro:
        names.append("worker-avro")
    runs: dict[str, list[Drain]] = {name: [] for name in names}
    env = {**payload_env, **dict(item.split("=", 1) for item in args.env)}
    sink = (
        otlp_sink() if any("{OTLP}" in v for s in variants.values() for v in s.values()) else None
    )
    if sink is not None:
        for settings in variants.values():
            for key, value in settings.items():
                settings[key] = value.replace("{OTLP}", sink)
    # On Kafka the results are read as a read_committed client would: an
    # exactly-once variant's answers count once their transaction committed.
    isolation = "read_uncommitted" if args.broker == "embedded" else "read_committed"
    broker = (
        secured[0]
        if secured
        else EmbeddedBroker()
        if args.broker == "embedded"
        else KafkaCluster(1)
    )
    registry = SchemaRegistryServer().start() if args.avro else None
    with broker, contextlib.ExitStack() as stack:
        if registry is not None:
            stack.callback(registry.stop)
        if secured:  # the listeners' ports are known once the cluster started
            await grant_everything(broker.bootstrap, "User:worker")
            variants.update(listener_variants(secured[0], secured[1], _BENCH_PASSWORD))
        topics = {"requests": "drain.requests", "results": "drain.results", "dlq": "drain.dlq"}
        if args.oip:  # the same requests as Open Inference Protocol JSON
            oip = [(k, encode_oip_request(decode_request(v))) for k, v in records]
            await create_topics(broker.bootstrap, {"drain.requests.oip": args.partitions})
            await produce_all(broker.bootstrap, "drain.requests.oip", oip,
                              partition_of=lambda i: i % args.partitions)  # fmt: skip
        if registry is not None:  # the same requests in Avro
            avro = avro_backlog(records, registry.url, "drain.requests.avro-value")
            await create_topics(broker.bootstrap, {"drain.requests.avro": args.partitions})
            await produce_all(broker.bootstrap, "drain.requests.avro", avro,
                              partition_of=lambda i: i % args.partitions)  # fmt: skip
        await create_topics(
            broker.bootstrap,
            {topics["requests"]: args.partitions, topics["results"]: args.partitions,
             topics["dlq"]: 1},
        )  # fmt: skip
        await produce_all(
            broker.bootstrap,
            topics["requests"],
            records,
            partition_of=lambda i: i % args.partitions,
        )
        for i in range(args.repeat):
            # Same records, fresh groups; alternate the order so neither always runs first.
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                if name == "ceiling":
                    d = await drain_ceiling(broker.bootstrap, topics["requests"], len(records))
                else:
                    # A fresh results topic per drain keeps the collector's count honest.
                    topics["results"] = f"drain.results.{name}.{i}"
                    await create_topics(broker.bootstrap, {topics["results"]: args.partitions})
                    extra = variants.get(name, {})
                    drained = topics
                    if name == "worker-oip":
                        drained = {**topics, "requests": "drain.requests.oip"}
                        extra = {"INFER_WORKER_KAFKA__CONTENT_TYPE": "application/json"}
                    if name == "worker-avro" and registry is not None:
                        drained = {**topics, "requests": "drain.requests.avro"}
                        extra = {"INFER_WORKER_SCHEMA_REGISTRY__URL": registry.url}
                    d = await drain_worker(
                        broker.bootstrap, drained, len(records), f"{name}{i}", {**env, **extra},
                        baseline_path if name == "baseline" else None,
                        1 if name == "baseline" else args.procs,
                        name if name in args.peers else None,
                        isolation,
                        avro_status(registry.url)
                        if name == "worker-avro" and registry is not None else None,
                    )  # fmt: skip
                    d.name = name
                runs[name].append(d)
                print(f"  {name:8s} {d.rate:10,.0f} rec/s  ({d.records} in {d.seconds:.2f} s"
                      + (f", mean batch {d.mean_batch:.1f}, {d.cpu_us_per_record:.0f} us CPU "
                         f"per record; the machine {d.host_us_per_record:.0f} us, "
                         f"{d.host_busy:.0%} busy)" if name != "ceiling" else ")"),
                      file=sys.stderr, flush=True)  # fmt: skip
    ratios = [w.rate / c.rate for w, c in zip(runs["worker"], runs["ceiling"], strict=True)]
    others = [*variants, *(["worker-oip"] if args.oip else []),
              *(["worker-avro"] if args.avro else [])]  # fmt: skip
    summary: dict[str, object] = {
        "broker": args.broker,
        "payload": args.payload,
        "tensor_lengths": list(args.tensor_lengths),
        "records": len(records),
        "partitions": args.partitions,
        "procs": args.procs,
        "env": env,
        "ceiling_rec_s": [round(d.rate) for d in runs["ceiling"]],
        "worker_rec_s": [round(d.rate) for d in runs["worker"]],
        "worker_mean_batch": [round(d.mean_batch, 1) for d in runs["worker"]],
        "worker_padding_per_data_element": [round(d.padding, 3) for d in runs["worker"]],
        "ratio_worker_to_ceiling": [round(r, 4) for r in ratios],
        "ratio_median": round(statistics.median(ratios), 4),
        **{f"{peer}_rec_s": [round(d.rate) for d in runs[peer]] for peer in args.peers},
        **{f"{name}_rec_s": [round(d.rate) for d in runs[name]] for name in others},
        **{
            f"{name}_padding_per_data_element": [round(d.padding, 3) for d in runs[name]]
            for name in variants
        },
        **{
            f"ratio_worker_to_{name}_median": round(
                statistics.median(
                    w.rate / v.rate for w, v in zip(runs["worker"], runs[name], strict=True)
                ),
                2,
            )
            for name in others
        },
        **{
            f"ratio_worker_to_{peer}_median": round(
                statistics.median(
                    w.rate / p.rate for w, p in zip(runs["worker"], runs[peer], strict=True)
                ),
                2,
            )
            for peer in args.peers
        },
        **(
            {
                "baseline_rec_s": [round(d.rate) for d in runs["baseline"]],
                "ratio_worker_to_baseline_median": round(
                    statistics.median(
                        w.rate / b.rate
                        for w, b in zip(runs["worker"], runs["baseline"], strict=True)
                    ),
                    2,
                ),
            }
            if args.baseline_path
            else {}
        ),
        # The processors' own cost, apart from the machine they share (benchmarks/cpu.py),
        # and how many times that of the worker each one's is (median of rounds).
        "cpu_us_per_record": {
            k: [d.cpu_us_per_record for d in v] for k, v in runs.items() if k != "ceiling"
        },
        "cpu_ratio_to_worker_median": cpu_ratios(runs),
        # The whole machine per record and its busy share: the rest of the
        # machine's cost per record is host minus the processor's own.
        "host_us_per_record": {
            k: [d.host_us_per_record for d in v] for k, v in runs.items() if k != "ceiling"
        },
        "host_busy": {k: [d.host_busy for d in v] for k, v in runs.items() if k != "ceiling"},
        "runs": {k: [asdict(d) for d in v] for k, v in runs.items()},
    }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--payload", choices=("digits", "text", "tensor"), default="digits")
    parser.add_argument(
        "--tensor-lengths",
        type=lambda text: tuple(int(v) for v in text.split(",")),
        default=(),
        help="tensor payload: the id lengths to draw from, e.g. 16,32,64,128 (default 1..128)",
    )
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="drains of each, alternating")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="INFER_WORKER_X=V",
        help="extra worker environment, e.g. INFER_WORKER_BATCHING__MAX_BATCH_SIZE=128",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=["tight_loop"],
        choices=PEERS,
        help="benchmarks/peers/NAME.py contenders (install the bench extra for faust and quix)",
    )
    parser.add_argument("--procs", type=int, default=1, help="worker processes (run --procs)")
    parser.add_argument(
        "--oip",
        action="store_true",
        help="also drain the same requests as Open Inference Protocol JSON (worker-oip)",
    )
    parser.add_argument(
        "--avro",
        action="store_true",
        help="also drain the same requests in Avro, the Schema Registry's format, with a "
        "real registry (worker-avro; --payload tensor or text)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:INFER_WORKER_X=V,...",
        help="also drain with the worker under other settings, e.g. "
        "nosplit:INFER_WORKER_BATCHING__SPLIT_BY_LENGTH=false; {OTLP} in a value is the "
        "URL of a local OTLP/HTTP sink the bench starts (tracing.endpoint)",
    )
    parser.add_argument("--baseline-path", help="also drain with the worker package in this dir")
    parser.add_argument(
        "--broker",
        choices=("embedded", "kafka", "kafka-secured"),
        default="embedded",
        help="kafka: a single-node Apache Kafka started for the run (needed for "
        "exactly-once variants; Java 17 and Maven, see README); kafka-secured: the "
        "same with TLS listeners, the worker also drained on SASL_SSL (SCRAM) and "
        "mutual TLS (variants sasl_ssl, mtls): the cost of TLS, same run",
    )
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    if args.baseline_path:
        args.baseline_path = os.path.abspath(args.baseline_path)
    with children_die_with_this_process("benchmarks.drain"):
        summary = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
