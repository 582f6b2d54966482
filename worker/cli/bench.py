"""``infer-worker demo`` and ``bench`` (the demo's run and a baseline, ``--sweep``,
``--model``): one parser shape for both, three runs behind ``bench``."""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.cli.common import Subparsers, add_command, number_list, parse_sets
from worker.flow.errors import ConfigError

SWEEP_DESCRIPTION = """\
With --sweep (the tuning loop): one worker process per batching setting
(batching.max_batch_size x batching.max_queue_delay_ms), each sent open-loop
Poisson arrivals at every --rates value for --duration seconds, on one embedded
broker. A rate is sustained when every request was answered ok and answers/s
kept within 5% of the offered rate. The recommended setting sustains the highest
rate with p99 <= --slo-p99-ms there and at every lower rate (ties: the lower
p99); its [batching] TOML lines and INFER_WORKER_BATCHING__* variables are
printed. The p99/p50 latency vs throughput curves go to --plot (matplotlib), the
points to --json. Exit 1 when no setting meets the SLO (the closest is printed)."""

SWEEP_EXAMPLES = """
  infer-worker bench --sweep --slo-p99-ms 20 --plot sweep.png --json sweep.json
  infer-worker bench --sweep --delays 0,2,5,10 --batch-sizes 32,64 --rates 200,1000,3000"""

MODEL_DESCRIPTION = """\
With --model (one model, end to end, in one run on the embedded broker): the
engine alone at the largest batch (img/s), a bare consumer draining the backlog
(the ingest ceiling, rec/s), `run --procs N` draining the same backlog (img/s,
mean batch, GPU busy fraction from NVML), then open-loop Poisson arrivals at half
that drain rate for --duration seconds (end-to-end p50/p95/p99 and each stage's
p50/p99 from the results' timing_us). digits: the bundled CPU model and digits;
resnet50: torchvision ResNet-50, random weights, torch engine, fp16, on the GPU,
with scikit-image's photographs at 256x256 (needs the gpu, torch and bench
extras); sentiment: the bundled text model on the CPU, sent its held-out
reviews as texts (--payload text; rates count texts). The summary goes to
--results-dir as <date>-<device>-<payload>.json."""

MODEL_EXAMPLES = """
  infer-worker bench --model digits --payload png
  infer-worker bench --model sentiment
  infer-worker bench --model resnet50 --payload jpeg --procs 4 --partitions 8"""

# bench --model's own flags: refused on the demo's and the sweep's runs.
_MODEL_ONLY = ("payload", "procs", "senders", "records", "results_dir")


def demo_command(args: argparse.Namespace) -> int:
    """``demo``, and ``bench`` (the same run, then the naive baseline)."""
    if getattr(args, "model", None):
        return _modelbench(args)
    for flag in _MODEL_ONLY:
        if getattr(args, flag, None) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: only with --model")
    if getattr(args, "sweep", False):
        return _sweep(args)
    if getattr(args, "pipeline", None) is not None:
        raise ConfigError("--pipeline: only with --sweep")
    from worker.bench.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            model=getattr(args, "demo_model", "digits"),
            repeat=args.repeat,
            partitions=args.partitions,
            json_out=args.json,
            baseline=args.command == "bench",
            rate=args.rate,
            overrides=parse_sets(args.set),
        )
    )


def _sweep(args: argparse.Namespace) -> int:
    """``bench --sweep``: the batching grid at several rates, and the setting to use."""
    from worker.bench.options import SweepOptions
    from worker.bench.sweep import run_sweep

    if args.rate:
        raise ConfigError("--rate: not with --sweep (give the rates to sweep as --rates)")
    opts = SweepOptions(
        delays=args.delays,
        rates=args.rates,
        duration=args.duration,
        slo_p99_ms=args.slo_p99_ms,
        plot=args.plot or None,
        json_out=args.json,
        partitions=args.partitions,
        overrides=parse_sets(args.set),
        pipeline=args.pipeline,
    )
    if args.batch_sizes is not None:
        opts.batch_sizes = args.batch_sizes
    return run_sweep(opts)


def _modelbench(args: argparse.Namespace) -> int:
    """``bench --model``: engine, ingest ceiling, worker drain and paced latency."""
    from worker.bench.modelbench import run_modelbench
    from worker.bench.options import (
        DEFAULT_RESULTS_DIR,
        ModelBenchOptions,
        default_payload,
    )

    if args.sweep:
        raise ConfigError("--model: not with --sweep")
    if getattr(args, "pipeline", None) is not None:
        raise ConfigError("--pipeline: only with --sweep")
    return run_modelbench(
        ModelBenchOptions(
            model=args.model,
            payload=args.payload or default_payload(args.model),
            procs=1 if args.procs is None else args.procs,
            senders=args.senders,
            records=args.records,
            partitions=args.partitions,
            duration=args.duration,
            rate=args.rate,
            results_dir=args.results_dir or DEFAULT_RESULTS_DIR,
            json_out=args.json,
            overrides=parse_sets(args.set),
        )
    )


def add_demo_and_bench(sub: Subparsers[argparse.ArgumentParser]) -> None:
    for name, summary, description, repeat in (
        (
            "demo",
            "end-to-end self-check on the bundled model",
            "Start the embedded broker and one worker process, stream the bundled model's "
            "held-out labelled digits (at 8x8, 16x16 and 24x24; --model sentiment: review "
            "texts), read every answer back, and "
            "check the accuracy equals the model's offline accuracy and every offset was "
            "committed. Exit 1 if anything is missing.",
            10,
        ),
        (
            "bench",
            "throughput and latency of the worker against a naive baseline",
            "The demo's run, then the same requests through a naive one-at-a-time loop "
            "(benchmarks/naive.py of a repository checkout: run this from there), and the ratio. "
            "For the backlog drain against the ingest ceiling and the peers see "
            "python -m benchmarks.drain and python -m benchmarks.latency.\n\n"
            + SWEEP_DESCRIPTION
            + "\n\n"
            + MODEL_DESCRIPTION,
            20,
        ),
    ):
        p = add_command(
            sub, name, summary, description, demo_command,
            epilog=f"examples:\n  infer-worker {name}\n"
            f"  infer-worker {name} --rate 300\n"
            f"  infer-worker {name} --set batching.max_batch_size=16"
            + (SWEEP_EXAMPLES + MODEL_EXAMPLES if name == "bench" else ""),
        )  # fmt: skip
        p.add_argument(
            "--repeat", type=int, default=repeat,
            help=f"send the held-out sample set this many times (default {repeat})",
        )  # fmt: skip
        p.add_argument("--partitions", type=int, default=4, help="input topic partitions")
        p.add_argument(
            "--rate", type=float, default=0.0,
            help="open-loop Poisson arrivals at this mean rate, requests/s "
            "(default: as fast as possible)",
        )  # fmt: skip
        p.add_argument("--json", help="also write the summary as JSON to this file")
        p.add_argument(
            "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
            help="worker setting for this run, e.g. batching.max_batch_size=16",
        )  # fmt: skip
        if name == "bench":
            _sweep_arguments(p)
            _model_arguments(p)
        else:
            p.add_argument(
                "--model", dest="demo_model", choices=("digits", "sentiment", "sensor"),
                default="digits",
                help="the bundled model to stream samples of: digits (images, the default), "
                "sentiment (review texts, tokenized by the worker) or sensor (a stateful "
                "anomaly detector: a sequence per sensor, the record key)",
            )  # fmt: skip


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    from worker.config import BatchingConfig

    default_batch = BatchingConfig().max_batch_size
    p.add_argument(
        "--sweep", action="store_true",
        help="run the batching grid at several rates and print the setting to use "
        "(--repeat and --rate do not apply)",
    )  # fmt: skip
    p.add_argument(
        "--delays", type=number_list(float), default=[0.0, 2.0, 5.0, 10.0], metavar="MS,...",
        help="with --sweep: batching.max_queue_delay_ms values (default 0,2,5,10)",
    )  # fmt: skip
    p.add_argument(
        "--batch-sizes", type=number_list(int), default=None, metavar="N,...",
        help=f"with --sweep: batching.max_batch_size values (default {default_batch}, "
        "the worker's default)",
    )  # fmt: skip
    p.add_argument(
        "--rates", type=number_list(float), default=[200.0, 1000.0, 3000.0], metavar="R,...",
        help="with --sweep: open-loop Poisson arrival rates, requests/s "
        "(default 200,1000,3000)",
    )  # fmt: skip
    p.add_argument(
        "--duration", type=float, default=5.0,
        help="with --sweep: seconds of arrivals per rate and setting; with --model: "
        "seconds of the paced run (default 5)",
    )  # fmt: skip
    p.add_argument(
        "--slo-p99-ms", type=float, default=50.0,
        help="with --sweep: the p99 end-to-end latency to meet, ms (default 50)",
    )  # fmt: skip
    p.add_argument(
        "--pipeline", default=None, metavar="NAME",
        help="with --sweep: sweep this pipeline (defined with --set pipelines.NAME.KEY=...) "
        "end to end instead of [model]; the requests are the digit images (input image), "
        "so its first model takes them",
    )  # fmt: skip
    p.add_argument(
        "--plot", default="sweep.png",
        help="with --sweep: the PNG to draw the curves to; needs matplotlib "
        "(default sweep.png; '' for none)",
    )  # fmt: skip


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """``bench --model``; --partitions, --duration, --rate, --json and --set apply too."""
    p.add_argument(
        "--model", choices=("digits", "resnet50", "sentiment"), default=None,
        help="benchmark this model end to end (see above); --rate then sets the paced "
        "rate (default: half the worker's drain rate)",
    )  # fmt: skip
    p.add_argument(
        "--payload", choices=("jpeg", "png", "raw", "text"), default=None,
        help="with --model: the image as a JPEG (quality 90) or PNG file, or a raw "
        "uint8 tensor (default jpeg); text for sentiment (its default)",
    )  # fmt: skip
    p.add_argument(
        "--procs", type=int, default=None,
        help="with --model: worker processes, as run --procs N (default 1); "
        "--partitions is raised to N when lower",
    )  # fmt: skip
    p.add_argument(
        "--senders", type=int, default=None,
        help="with --model: processes sending the paced requests (default: one per "
        "worker process, so the sender does not bind what it measures)",
    )  # fmt: skip
    p.add_argument(
        "--records", type=int, default=None,
        help="with --model: the backlog to drain (default: at least 10 s of drain at the "
        "rate expected for the model, payload and --procs)",
    )  # fmt: skip
    p.add_argument(
        "--results-dir", type=Path, default=None,
        help="with --model: where the summary JSON goes (default benchmarks/results)",
    )  # fmt: skip
