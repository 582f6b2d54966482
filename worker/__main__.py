"""Command line: ``infer-worker run | produce | consume | demo | bench | config |
verify | build-engine``. Nothing but argument parsing happens at import time."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from worker import __version__, logs
from worker.config import KafkaConfig, Settings, load_settings, redacted
from worker.errors import ConfigError, WorkerError

log = structlog.get_logger("worker")

DESCRIPTION = """\
Serve a model to a Kafka stream: requests (msgpack: an image tensor or an image
file) are read from input topics, batched, run, and answered on an output topic;
records that cannot be answered go to a dead-letter topic. Input offsets are
committed only after the answers were acknowledged by the broker."""

EPILOG = """\
first steps, without Docker or Kafka (each in its own terminal):
  infer-worker run --embedded       embedded broker + topics + a worker
  infer-worker produce --samples 3  send 3 bundled digits, print their answers
  infer-worker produce digit.png    send your own image (JPEG, PNG, WebP, .npy)

more:
  infer-worker demo                          end-to-end self-check, prints a summary
  infer-worker run --config worker.toml      serve against your Kafka
  infer-worker verify --config worker.toml   were all requests answered?

settings: a TOML file (--config) and/or INFER_WORKER_<SECTION>__<KEY> variables,
e.g. INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS=kafka:9092; `infer-worker config`
prints the result."""

RUN_DESCRIPTION = """\
Serve the configured model until SIGTERM or Ctrl-C, then drain: stop fetching,
finish in-flight batches, await acknowledgements, commit and leave the group
(within shutdown.drain_timeout_ms; a second signal gives up draining).

Without --config, the built-in defaults apply (Kafka at localhost:9092, topics
infer.requests -> infer.results, errors to infer.dlq, the bundled digits model
on the CPU), each overridable by an INFER_WORKER_<SECTION>__<KEY> variable. The
input topics must exist (--embedded creates them).

exit status: 0 drained and stopped; 1 a stage failed (engine dead, delivery
failed for good, failure budget exceeded); 2 a configuration error (the message
names the setting) or a stop without draining."""


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
extras). The summary goes to --results-dir as <date>-<device>-<payload>.json."""

MODEL_EXAMPLES = """
  infer-worker bench --model digits --payload png
  infer-worker bench --model resnet50 --payload jpeg --procs 4 --partitions 8"""


def _kafka_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file to take Kafka settings and topics from")
    parser.add_argument(
        "--bootstrap-servers", help="host:port (default: the config's, else localhost:9092)"
    )


def _settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config)
    if getattr(args, "bootstrap_servers", None):
        kafka = dataclasses.replace(settings.kafka, bootstrap_servers=args.bootstrap_servers)
        settings = dataclasses.replace(settings, kafka=kafka)
    return settings


# --- commands ------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    logs.configure(settings.logging)
    log.info("starting", version=__version__, config=args.config, embedded=args.embedded)
    if args.procs < 1:
        raise ConfigError(f"--procs: must be >= 1, got {args.procs}")
    if args.embedded:
        from worker.tools.local import run_embedded

        return run_embedded(settings, args.partitions, args.procs, args.config)
    if args.procs > 1:
        from worker.pipeline.supervisor import supervise

        return supervise(settings, args.procs, args.config)
    from worker.pipeline.service import serve

    return asyncio.run(serve(settings))


def _cmd_produce(args: argparse.Namespace) -> int:
    from worker.tools.client import run_produce

    s = _settings(args)
    topic = args.topic or s.kafka.input_topics[0]
    kafka = dataclasses.replace(s.kafka, input_topics=(topic,))
    return run_produce(
        kafka, s.limits, args.files, args.samples, not args.no_wait, args.timeout, args.json,
        texts=args.text, input_name=args.input, sample_model=args.model, oip=args.oip,
    )  # fmt: skip


def _cmd_consume(args: argparse.Namespace) -> int:
    from worker.tools.client import run_consume

    kafka: KafkaConfig = _settings(args).kafka
    return run_consume(kafka, args.id, args.timeout, args.json)


def _cmd_config(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    print(json.dumps(redacted(settings), indent=2))
    return 0


def _parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        out[key.strip()] = value.strip()
    return out


def _cmd_demo(args: argparse.Namespace) -> int:
    """``demo``, and ``bench`` (the same run, then the naive baseline)."""
    if getattr(args, "model", None):
        return _cmd_modelbench(args)
    for flag in _MODEL_ONLY:
        if getattr(args, flag, None) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: only with --model")
    if getattr(args, "sweep", False):
        return _cmd_sweep(args)
    from worker.tools.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            model=getattr(args, "demo_model", "digits"),
            repeat=args.repeat,
            partitions=args.partitions,
            json_out=args.json,
            baseline=args.command == "bench",
            rate=args.rate,
            overrides=_parse_sets(args.set),
        )
    )


def _cmd_sweep(args: argparse.Namespace) -> int:
    """``bench --sweep``: the batching grid at several rates, and the setting to use."""
    from worker.tools.sweep import SweepOptions, run_sweep

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
        overrides=_parse_sets(args.set),
    )
    if args.batch_sizes is not None:
        opts.batch_sizes = args.batch_sizes
    return run_sweep(opts)


_MODEL_ONLY = ("payload", "procs", "records", "results_dir")


def _cmd_modelbench(args: argparse.Namespace) -> int:
    """``bench --model``: engine, ingest ceiling, worker drain and paced latency."""
    from worker.tools.modelbench import DEFAULT_RESULTS_DIR, ModelBenchOptions, run_modelbench

    if args.sweep:
        raise ConfigError("--model: not with --sweep")
    return run_modelbench(
        ModelBenchOptions(
            model=args.model,
            payload=args.payload or "jpeg",
            procs=1 if args.procs is None else args.procs,
            records=args.records,
            partitions=args.partitions,
            duration=args.duration,
            rate=args.rate,
            results_dir=args.results_dir or DEFAULT_RESULTS_DIR,
            json_out=args.json,
            overrides=_parse_sets(args.set),
        )
    )


def _cmd_build_engine(args: argparse.Namespace) -> int:
    from worker.config import LoggingConfig
    from worker.tools import build_engine

    logs.configure(LoggingConfig(format="console", level="info"))  # stderr; stdout = results
    return build_engine.run(args)


# --- parsers -------------------------------------------------------------------------


def _add(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
    func: Callable[[argparse.Namespace], int],
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=func)
    return parser


def _run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _add(
        sub, "run", "serve the model to Kafka until SIGTERM / Ctrl-C", RUN_DESCRIPTION, _cmd_run,
        epilog="examples:\n  infer-worker run --embedded\n"
        "  INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS=kafka:9092 infer-worker run\n"
        "  infer-worker run --config worker.toml --procs 4",
    )  # fmt: skip
    p.add_argument("--config", help="TOML file (INFER_WORKER_* variables override it)")
    p.add_argument(
        "--embedded",
        action="store_true",
        help="also start the embedded broker (localhost:9092, or a free port it names) "
        "and create the configured topics; for trying the worker without Kafka",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        help="worker processes in the group, on this host (default 1); metrics on "
        "metrics.port + i. One process uses about one core for its per-record work",
    )
    p.add_argument(
        "--partitions",
        type=int,
        default=4,
        help="with --embedded: partitions of the input and output topics (default 4)",
    )


def _client_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _add(
        sub, "produce", "send images or texts as requests and print their answers",
        "Send image files (JPEG, PNG or WebP as they are; .npy arrays as tensors), texts "
        "(--text) or a bundled model's samples to the input topic, each with a unique id, "
        "then wait for their answers and print them (top classes, the outputs, or the error).",
        _cmd_produce,
        epilog="examples:\n  infer-worker produce --samples 3\n  infer-worker produce a.png b.jpg\n"
        '  infer-worker produce --text "The battery was great"\n'
        "  infer-worker produce --samples 3 --model sentiment",
    )  # fmt: skip
    p.add_argument("files", nargs="*", metavar="IMAGE", help="image files or .npy arrays")
    p.add_argument(
        "--text", action="append", default=[], help="send this text (repeatable)"
    )  # fmt: skip
    p.add_argument(
        "--input", default=None,
        help="the request input to send them as (default: image for files, text for texts)",
    )  # fmt: skip
    p.add_argument("--samples", type=int, default=0, help="also send N bundled samples")
    p.add_argument(
        "--oip", action="store_true",
        help="send Open Inference Protocol v2 JSON (content-type: application/json), not msgpack",
    )  # fmt: skip
    p.add_argument(
        "--model", choices=("digits", "sentiment"), default="digits",
        help="whose samples --samples sends (default digits)",
    )  # fmt: skip
    p.add_argument("--topic", help="input topic (default: the config's first input topic)")
    p.add_argument("--no-wait", action="store_true", help="send only; do not wait for answers")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    p.add_argument("--json", action="store_true", help="print each result as one JSON line")
    _kafka_flags(p)
    c = _add(
        sub, "consume", "print results as they arrive",
        "Print the results on the output topic (from its beginning; no consumer group "
        "is joined, nothing is committed) and the DLQ's records, until --timeout or Ctrl-C. "
        "With --id, only those results, and exit once all have arrived (1 if some did not).",
        _cmd_consume,
        epilog="examples:\n  infer-worker consume --timeout 10\n"
        "  infer-worker consume --id sample-0-1a2b3c4d --timeout 30",
    )  # fmt: skip
    c.add_argument("--id", action="append", default=[], help="wait for this request id")
    c.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    c.add_argument("--json", action="store_true", help="print each result as one JSON line")
    _kafka_flags(c)


def _demo_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
            "(bench/naive.py of a repository checkout: run this from there), and the ratio. "
            "For the backlog drain against the ingest ceiling and the peers see "
            "python -m bench.drain and python -m bench.latency.\n\n"
            + SWEEP_DESCRIPTION
            + "\n\n"
            + MODEL_DESCRIPTION,
            20,
        ),
    ):
        p = _add(
            sub, name, summary, description, _cmd_demo,
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
                "--model", dest="demo_model", choices=("digits", "sentiment"), default="digits",
                help="the bundled model to stream samples of: digits (images, the default) "
                "or sentiment (review texts, tokenized by the worker)",
            )  # fmt: skip


def _number_list(kind: Callable[[str], float]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {exc}") from exc

    return parse


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    from worker.config import BatchingConfig

    default_batch = BatchingConfig().max_batch_size
    p.add_argument(
        "--sweep", action="store_true",
        help="run the batching grid at several rates and print the setting to use "
        "(--repeat and --rate do not apply)",
    )  # fmt: skip
    p.add_argument(
        "--delays", type=_number_list(float), default=[0.0, 2.0, 5.0, 10.0], metavar="MS,...",
        help="with --sweep: batching.max_queue_delay_ms values (default 0,2,5,10)",
    )  # fmt: skip
    p.add_argument(
        "--batch-sizes", type=_number_list(int), default=None, metavar="N,...",
        help=f"with --sweep: batching.max_batch_size values (default {default_batch}, "
        "the worker's default)",
    )  # fmt: skip
    p.add_argument(
        "--rates", type=_number_list(float), default=[200.0, 1000.0, 3000.0], metavar="R,...",
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
        "--plot", default="sweep.png",
        help="with --sweep: the PNG to draw the curves to; needs matplotlib "
        "(default sweep.png; '' for none)",
    )  # fmt: skip


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """``bench --model``; --partitions, --duration, --rate, --json and --set apply too."""
    p.add_argument(
        "--model", choices=("digits", "resnet50"), default=None,
        help="benchmark this model end to end (see above); --rate then sets the paced "
        "rate (default: half the worker's drain rate)",
    )  # fmt: skip
    p.add_argument(
        "--payload", choices=("jpeg", "png", "raw"), default=None,
        help="with --model: the image as a JPEG (quality 90) or PNG file, or a raw "
        "uint8 tensor (default jpeg)",
    )  # fmt: skip
    p.add_argument(
        "--procs", type=int, default=None,
        help="with --model: worker processes, as run --procs N (default 1); "
        "--partitions is raised to N when lower",
    )  # fmt: skip
    p.add_argument(
        "--records", type=int, default=None,
        help="with --model: the backlog to drain (default 5000 for digits, 20000 for resnet50)",
    )  # fmt: skip
    p.add_argument(
        "--results-dir", type=Path, default=None,
        help="with --model: where the summary JSON goes (default benchmarks/results)",
    )  # fmt: skip


def _tool_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cfg = _add(
        sub, "config", "print the effective configuration (secrets masked)",
        "Print the settings the worker would run with: defaults, then --config, then "
        "INFER_WORKER_* variables, as JSON with secrets masked.",
        _cmd_config,
    )  # fmt: skip
    cfg.add_argument("--config", help="TOML file")

    from worker.tools import build_engine, verify

    ver = _add(
        sub, "verify", "report lost, duplicated and reordered answers",
        "Read the input, output and DLQ topics from the beginning (no consumer group) and "
        "report, per input partition, requests without an answer, answered twice, or "
        "answered out of order. Exit 0 all answered; 1 something lost (or duplicated "
        "with --strict); 2 the check could not be made.",
        verify.run,
    )  # fmt: skip
    verify.add_arguments(ver)
    build = _add(
        sub, "build-engine", "build a TensorRT plan from ONNX (cached)",
        "Build a TensorRT plan from an ONNX model with one optimisation profile per GPU "
        "slot, at the given precision, cached under a key of the model, TensorRT version, "
        "GPU, precision and batch range. Needs TensorRT 10 (exit 2 without it).",
        _cmd_build_engine,
    )  # fmt: skip
    build_engine.add_arguments(build)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infer-worker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _run_parser(sub)
    _client_parsers(sub)
    _demo_parsers(sub)
    _tool_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"infer-worker: configuration error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"infer-worker: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
