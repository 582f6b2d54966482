"""``infer-worker bench --model NAME --payload jpeg|png|raw|text``: one model, end to end.

One run, on the embedded broker and one machine, measures the same records four
ways, so the ratios between the figures mean something:

1. **engine alone** (``engine_img_s``, ``engine``): the worker's own engine,
   loaded with the run's settings, on its largest batch.
2. **ingest ceiling** (``ingest_ceiling_rec_s``): bare aiokafka consumers that
   msgpack-decode the backlog and discard it (``worker.bench.ceiling``), as many
   readers as the worker has processes (``ingest_ceiling_readers``), each its
   share of the partitions.
3. **worker drain** (``worker_img_s``, ``drain``): ``infer-worker run --procs N``
   in a fresh group drains the same backlog, every request answered ``ok``;
   the rate is the drain's steady state. The backlog is sized for at least ten
   seconds of drain at the rate expected (``backlog``) unless ``--records``.
4. **paced** (``paced``, ``openloop``): the same workers, sent open-loop Poisson
   arrivals at half the drain rate (or ``--rate``) for ``--duration`` seconds:
   end-to-end p50/p95/p99, and each stage's p50 and p99 from ``timing_us``.

Models and payloads: ``options`` and ``payloads``. Outputs: ``report``. For the
text model (``sentiment``) the rates count texts; the summary's keys keep their
``img_s`` names so every results file has one shape.
Stopped by SIGTERM or SIGINT, it kills the broker and every worker process
before it exits (``worker.ops.children``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker import __version__
from worker.app.plan import as_run
from worker.bench.backlog import plan_backlog, short_drain_note
from worker.bench.ceiling import drain_ceiling
from worker.bench.drain import WorkerDrain, drain_worker, open_nvml
from worker.bench.engine import engine_rate
from worker.bench.openloop import paced
from worker.bench.options import (
    BenchError,
    ModelBenchOptions,
    check_options,
    run_overrides,
    unit,
)
from worker.bench.payloads import Records, Value, payload_inputs, request_records, requests
from worker.bench.report import (
    command_line,
    library_versions,
    note,
    ratio,
    run_device,
    settings_record,
    table,
    write_summary,
)
from worker.config import Settings, load_settings
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import override_env, spawn_worker
from worker.ops.topics import Collector, produce_all


async def _bench(opts: ModelBenchOptions) -> dict[str, Any]:
    check_options(opts)
    opts.partitions = max(opts.partitions, opts.procs)
    started = time.monotonic()
    name, inputs = payload_inputs(opts.model, opts.payload)  # before building (exit 2 early)
    overrides = run_overrides(opts)
    # The batch size the worker will derive from the model, for the engine alone too.
    settings = as_run(load_settings(env=override_env(overrides)))
    device = run_device(settings)
    sample = request_records(name, inputs, "size", len(inputs))
    record_bytes = float(np.mean([len(v) for _, v in sample]))
    print(
        f"infer-worker bench --model {opts.model} --payload {opts.payload}: {device}, "
        f"{settings.model.backend} engine, {opts.procs} process(es), {opts.partitions} "
        f"partitions, records of {record_bytes:,.0f} bytes on average, embedded broker",
        flush=True,
    )
    note(f"engine alone at batch {settings.batching.max_batch_size} ...")
    engine_img_s = await asyncio.to_thread(
        engine_rate, settings, requests(name, inputs, "engine", len(inputs)), opts.engine_seconds
    )
    note(f"engine alone: {engine_img_s:,.0f} {unit(opts.model)}")
    plan = plan_backlog(opts.model, opts.payload, opts.procs, engine_img_s, record_bytes)
    n = opts.records or plan.records
    if opts.records:
        note(f"backlog: {n:,} records (--records)")
    else:
        note(
            f"backlog: {n:,} records, {plan.seconds:.0f} s at the {plan.expected_rate:,.0f} "
            f"{unit(opts.model)} expected (bound: {plan.bound})"
        )
    backlog = request_records(name, inputs, "drain", n)
    nvml, nvml_reason = open_nvml(settings)
    try:
        with EmbeddedBroker() as broker:
            ceiling, drain, paced_run, exit_code = await _on_broker(
                broker, opts, settings, overrides, name, inputs, backlog, nvml
            )
    finally:
        if nvml is not None:
            nvml.close()
    short = short_drain_note(drain.seconds, drain.rate, n)
    if short:
        note(short)
    return {
        "date": dt.date.today().isoformat(),
        "device": device,
        "model": opts.model,
        "payload": opts.payload,
        "procs": opts.procs,
        "partitions": opts.partitions,
        "records": n,
        "records_sized_by": "--records" if opts.records else f"time (bound: {plan.bound})",
        "expected_img_s": round(plan.expected_rate, 1),
        "record_bytes_mean": round(record_bytes, 1),
        "engine_batch": settings.batching.max_batch_size,
        "engine_img_s": round(engine_img_s, 1),
        "ingest_ceiling_rec_s": round(ceiling, 1),
        "ingest_ceiling_readers": min(opts.procs, opts.partitions),
        "worker_img_s": round(drain.rate, 1),
        "worker_first_to_last_img_s": round(drain.first_to_last_rate, 1),
        "worker_drain_s": round(drain.seconds, 3),
        "worker_steady_s": round(drain.steady_seconds, 3),
        "worker_join_s": round(drain.join_seconds, 3),
        "worker_to_ceiling": ratio(drain.rate, ceiling),
        "worker_to_engine": ratio(drain.rate, engine_img_s),
        "mean_batch": round(drain.mean_batch, 2),
        "gpu_busy": drain.gpu_busy,
        "gpu_busy_note": nvml_reason,
        # Per process, the most GPU memory it held while draining (run --procs N).
        "gpu_memory_mib_per_process": [
            None if b is None else round(b / 2**20, 1) for b in drain.gpu_memory_per_process
        ],
        "drain_note": short,
        "paced": paced_run,
        "worker_exit": exit_code,
        "command": command_line(opts, n),
        "settings": settings_record(settings, overrides),
        "versions": {"worker": __version__, "python": platform.python_version(),
                     **library_versions(settings)},
        "wall_seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip


async def _on_broker(
    broker: EmbeddedBroker,
    opts: ModelBenchOptions,
    settings: Settings,
    overrides: Mapping[str, str],
    name: str,
    inputs: Sequence[Value],
    backlog: Records,
    nvml: Any,
) -> tuple[float, WorkerDrain, dict[str, Any], int]:
    """Ceiling, drain and paced run on one broker; the worker must then stop
    cleanly (exit 0), or the run fails."""
    topics = {kind: f"bench.{kind}" for kind in ("requests", "results", "dlq")}
    parts = opts.partitions
    await create_topics(
        broker.bootstrap,
        {topics["requests"]: parts, topics["results"]: parts, topics["dlq"]: 1},
    )
    # The whole backlog is in the topic before anything reads it: producing while
    # the worker drains would time the producer, slower than any consumer here.
    await produce_all(
        broker.bootstrap, topics["requests"], backlog, partition_of=lambda i: i % parts
    )
    readers = min(opts.procs, parts)
    counts = {p: len(range(p, len(backlog), parts)) for p in range(parts)}
    ceiling = await drain_ceiling(broker.bootstrap, topics["requests"], len(backlog),
                                  readers=readers, per_partition=counts)  # fmt: skip
    note(f"ingest ceiling: {ceiling.rate:,.0f} rec/s ({readers} reader{'s' * (readers > 1)})")
    worker = spawn_worker(
        broker.bootstrap,
        input_topics=[topics["requests"]],
        output_topic=topics["results"],
        dlq_topic=topics["dlq"],
        group_id="bench-worker",
        extra_env={"INFER_WORKER_LOGGING__LEVEL": "warning", **override_env(overrides)},
        command=("run", "--procs", str(opts.procs)),
    )
    collector = Collector(broker.bootstrap, [topics["results"], topics["dlq"]])
    try:
        await collector.start()
        keys = {k for k, _ in backlog if k is not None}
        drain = await drain_worker(opts.procs, parts, topics, worker, collector, keys, nvml)
        note(
            f"worker drain: {drain.rate:,.0f} {unit(opts.model)} steady "
            f"({drain.steady_seconds:.1f} s of {drain.seconds:.1f} s), "
            f"mean batch {drain.mean_batch:.1f}"
        )
        rate = opts.rate or drain.rate / 2
        note(f"paced at {rate:,.0f} requests/s for {opts.duration:g} s ...")
        paced_run = await paced(
            broker.bootstrap, settings, topics, worker, collector, name, inputs,
            rate=rate, duration=opts.duration, procs=opts.procs, partitions=parts,
            senders=opts.senders or opts.procs,
        )  # fmt: skip
        exit_code = await asyncio.to_thread(worker.terminate)
    finally:
        worker.kill()
        await collector.stop()
    if paced_run["answered"] != paced_run["sent"]:
        raise BenchError(
            f"paced run: {paced_run['answered']} of {paced_run['sent']} requests answered ok "
            f"({paced_run['errors']} errors)"
        )
    if exit_code != 0:
        raise BenchError(f"the worker exited with {exit_code}; its log: {worker.log_path}")
    return ceiling.rate, drain, paced_run, exit_code


def run_modelbench(opts: ModelBenchOptions) -> int:
    """0 when every request was answered ok and the worker stopped cleanly (the
    summary is written and printed); BenchError (exit 1) otherwise; ConfigError
    (exit 2) for bad options or a missing library."""
    with children_die_with_this_process("bench"):
        summary = asyncio.run(_bench(opts))
    print(table(summary))
    path = write_summary(summary, opts)
    print(f"results: {path}" + (f" (and {opts.json_out})" if opts.json_out else ""))
    return 0
