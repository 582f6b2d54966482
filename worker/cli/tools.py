"""``infer-worker config``, ``models``, ``verify``, ``compare`` and
``build-engine``: the operator's tools."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from worker.cli.common import Subparsers, add_command
from worker.config import load_settings, redacted
from worker.obs import logs

if TYPE_CHECKING:
    from worker.config import Settings
    from worker.config.repository_files import ListedVersion


def config_command(args: argparse.Namespace) -> int:
    import asyncio

    from worker.app.preflight import checked
    from worker.config import LoggingConfig

    settings = load_settings(args.config)
    if not args.settings_only:
        # What loading says goes to stderr, warnings only: stdout is the settings' JSON.
        logs.configure(LoggingConfig(format="console", level="warning"))
        settings = asyncio.run(checked(settings))
    print(json.dumps(redacted(settings), indent=2))
    return 0


def models_command(args: argparse.Namespace) -> int:
    from worker.config.models import served
    from worker.config.repository_files import listing

    settings = load_settings(args.config)  # checked as run checks settings (exit 2)
    if args.action == "load":
        return _load_version(settings, args.name, args.version, args.settings)
    if args.action == "unload":
        return _unload(settings, args.name)
    versions = listing(settings.repository) if settings.repository.path else ()
    rows = [("MODEL", "VERSION", "SERVED", "FROM")]
    for m in served(settings):
        if m.key == "model" or m.key.startswith("models."):
            rows.append((m.name, "-", "yes", f"[{m.key}] {m.config.path}"))
        rows += [_version_row(v, m.config.path) for v in versions if v.name == m.name]
    names = {m.name for m in served(settings)}
    rows += [_version_row(v, "") for v in versions if v.name not in names]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[3])
    if settings.kafka.control_topic:
        _print_desired(settings)
    return 0


def _print_desired(settings: Settings) -> None:
    """Each model's desired state on the control topic, as every member will
    apply it (its last record), after the repository's table."""
    import asyncio

    from aiokafka.errors import KafkaError

    from worker.app.desired import desired_state
    from worker.flow.errors import BrokerUnavailable
    from worker.kafka import control

    topic = settings.kafka.control_topic
    limit = settings.kafka.request_timeout_s + 5.0
    try:
        states = asyncio.run(asyncio.wait_for(control.read_states(settings.kafka), limit))
    except (TimeoutError, KafkaError) as exc:
        raise BrokerUnavailable(f"kafka.control_topic: {topic!r} not read within {limit:.0f} s "
                                f"({exc!r}); the repository's table above is complete") from exc
    print(f"\n{topic}: {len(states)} model(s) set" + (":" if states else ""))
    for name, value in sorted(states.items()):
        try:
            desired = desired_state(value)
        except ValueError as exc:  # every member keeps the state before it
            print(f"  {name}  its last record refused ({exc}): the one before it applies")
            continue
        if desired.version is None:
            print(f"  {name}  unloaded")
        else:
            keys = f" with settings {json.dumps(desired.settings)}" if desired.settings else ""
            print(f"  {name}  version {desired.version}{keys}")


def _load_version(settings: Settings, name: str | None, version: int | None,
                  overrides: str | None = None) -> int:  # fmt: skip
    """``models load NAME --version N [--settings JSON]``: the model's desired
    state written to the control topic, which every member reads and applies
    (worker.app.control); checked against the repository first, the settings
    over the version's model.toml too (exit 2 naming what is wrong)."""
    import asyncio
    import json

    from worker.app.desired import Desired, carried, checked_settings, kept_topics
    from worker.config.models import routing
    from worker.config.repository_files import listing, load_version, scan
    from worker.flow.errors import ConfigError
    from worker.kafka import control

    topic = settings.kafka.control_topic
    if not topic:
        raise ConfigError("kafka.control_topic: not set: a model's version is set through it")
    if not name or version is None:
        raise ConfigError("models load: name the model and --version (models load NAME "
                          "--version N)")  # fmt: skip
    held = [v.version for v in listing(settings.repository) if v.name == name]
    if not held:
        raise ConfigError(f"models load: {name!r} is not a model of the repository "
                          f"({settings.repository.path})")  # fmt: skip
    if version not in held:
        raise ConfigError(f"models load: {name!r} has no version {version} (it holds "
                          f"{', '.join(map(str, held))})")  # fmt: skip
    given: dict[str, object] = {}
    if overrides is not None:
        try:
            given = checked_settings(json.loads(overrides))
        except (json.JSONDecodeError, ValueError) as exc:
            raise ConfigError(f"models load: --settings: {exc}") from None
        entry = next(e for e in scan(settings.repository) if e.name == name)
        load_version(entry, version, given)  # the keys build as the worker builds them
        if name in settings.models:  # served as configured: its topics its own
            mine = routing(settings).topics_of(name)
            if (moved := kept_topics(name, given, mine)) is not None:
                raise ConfigError(f"models load: --{moved}")
    last = asyncio.run(control.read_states(settings.kafka)).get(name)
    state = carried(Desired(version, given), last).value()  # topics a record gave it kept
    asyncio.run(control.write(settings.kafka, name, state))
    print(f"{name}: version {version} written to {topic}; every member serves it at that "
          "version (one not serving it yet loads it)")  # fmt: skip
    return 0


def _unload(settings: Settings, name: str | None) -> int:
    """``models unload NAME``: a tombstone for the model on the control topic;
    every member serving it from the repository unloads it (worker.app.control)."""
    import asyncio

    from worker.config.repository_files import listing
    from worker.flow.errors import ConfigError
    from worker.kafka import control

    topic = settings.kafka.control_topic
    if not topic:
        raise ConfigError("kafka.control_topic: not set: a model is unloaded through it")
    if not name:
        raise ConfigError("models unload: name the model (models unload NAME)")
    if not any(v.name == name for v in listing(settings.repository)):
        raise ConfigError(f"models unload: {name!r} is not a model of the repository "
                          f"({settings.repository.path})")  # fmt: skip
    asyncio.run(control.write(settings.kafka, name, None))
    print(f"{name}: unloaded through {topic}; every member serving it frees it and answers its "
          "requests unknown_model until a version is loaded again")  # fmt: skip
    return 0


def _version_row(v: ListedVersion, path: str) -> tuple[str, str, str, str]:
    """A repository version: its model file where served, else its directory."""
    return (v.name, str(v.version), "yes" if v.served else "no",
            path if v.served else str(v.directory))  # fmt: skip


def build_engine_command(args: argparse.Namespace) -> int:
    from worker.config import LoggingConfig
    from worker.ops import build_engine

    logs.configure(LoggingConfig(format="console", level="info"))  # stderr; stdout = results
    return build_engine.run(args)


def topics_command(args: argparse.Namespace) -> int:
    from worker.cli.common import client_settings
    from worker.flow.errors import ConfigError
    from worker.ops import provision

    s = client_settings(args)
    if args.action == "check":
        return provision.check(s)
    if args.partitions < 1 or (args.replication_factor is not None and args.replication_factor < 1):
        raise ConfigError("--partitions and --replication-factor must be >= 1")
    return provision.create(s, args.partitions, args.replication_factor)


def add_tools(sub: Subparsers[argparse.ArgumentParser]) -> None:
    from worker.cli.common import kafka_flags
    from worker.config.topics import DEFAULT_PARTITIONS

    top = add_command(
        sub, "topics", "list, check or create the topics a configuration needs",
        "check: list every topic the configuration names (input, output, DLQ, crash guard, "
        "state changelog), where it is named and whether the cluster has it as needed; exit "
        "0 all there, 1 some missing or wrong. create: make the missing ones (the worker "
        "never creates topics), compacted where they must be, then list them as check does. "
        "Existing topics are never changed. Any cluster the configuration's Kafka settings "
        "reach, secured ones included.",
        topics_command,
        epilog="examples:\n  infer-worker topics check --config worker.toml\n"
        "  infer-worker topics create --config worker.toml --partitions 12 "
        "--replication-factor 3",
    )  # fmt: skip
    top.add_argument("action", choices=("check", "create"))
    top.add_argument(
        "--partitions", type=int, default=DEFAULT_PARTITIONS, metavar="N",
        help=f"create: partitions of the input and output topics (default {DEFAULT_PARTITIONS}; "
        "the DLQ and crash guard get 1, a state changelog the input topic's)",
    )  # fmt: skip
    top.add_argument(
        "--replication-factor", type=int, default=None, metavar="R",
        help="create: replicas of each new topic (default: the smaller of 3 and the brokers)",
    )  # fmt: skip
    kafka_flags(top)

    cfg = add_command(
        sub, "config", "print the effective configuration (secrets masked)",
        "Check the configuration as `run` does before it contacts Kafka (every model "
        "loaded, bound and probed, the memory budget, each pipeline's tensors), then print "
        "the settings the worker would run with: defaults, then --config, then "
        "INFER_WORKER_* variables, as JSON with secrets masked; a batch size the worker "
        "derives from the model is derived here too. Exit 2 on any mistake `run` would "
        "refuse, naming the key; Kafka is not contacted.",
        config_command,
    )  # fmt: skip
    cfg.add_argument("--config", help="TOML file")
    cfg.add_argument(
        "--settings-only", action="store_true",
        help="check the settings alone, loading no model (a GPU configuration on a machine "
        "without one); what only the models show (their inputs, outputs, memory, a "
        "pipeline's tensors) is then not checked",
    )  # fmt: skip

    mod = add_command(
        sub, "models", "list the models a configuration serves, the repository's versions",
        "list: every model the configuration serves, in the worker's order, with where it is "
        "configured ([model], [models.NAME]) or, for a model of the [repository], each of its "
        "versions and which one the version policy serves; then the repository's models left "
        "out (repository.models). The settings are checked as `run` checks them before "
        "loading a model (exit 2 naming the key); no model is loaded. With "
        "kafka.control_topic, each model's desired state as the members apply it (its last "
        "record there: a version, its settings, or unloaded) follows. "
        "load NAME --version N: write the model's desired version to kafka.control_topic; "
        "every member serving it from the repository swaps that version in while serving "
        "(and loads it, where it was unloaded). unload NAME: write a tombstone for the "
        "model; every member frees it and answers its requests unknown_model until a "
        "version is loaded again (docs/guides/models.md).",
        models_command,
        epilog="examples:\n  infer-worker models list --config worker.toml\n"
        "  infer-worker models load churn --version 3 --config worker.toml\n"
        "  infer-worker models unload churn --config worker.toml",
    )  # fmt: skip
    mod.add_argument("action", choices=("list", "load", "unload"))
    mod.add_argument("name", nargs="?", help="load, unload: the repository model")
    mod.add_argument("--version", type=int, help="load: the version to serve, a version "
                     "directory of the model in the repository")  # fmt: skip
    mod.add_argument("--settings", help="load: JSON of [models.NAME] keys over the version's "
                     "model.toml, each replacing its value whole (not name, path, "
                     "state_topic, backend, reload_interval_s; topics: a model's, kept from "
                     "its last record where not given)")  # fmt: skip
    mod.add_argument("--config", help="TOML file")

    from worker.ops import build_engine, compare, verify

    ver = add_command(
        sub, "verify", "report lost, duplicated and reordered answers",
        "Read the input, output and DLQ topics from the beginning (no consumer group) and "
        "report, per input partition, requests without an answer, answered twice, or "
        "answered out of order. Exit 0 all answered; 1 something lost (or duplicated "
        "with --strict); 2 the check could not be made.",
        verify.run,
    )  # fmt: skip
    verify.add_arguments(ver)
    cmp = add_command(
        sub, "compare", "compare a candidate's answers with production's (shadow rollout)",
        "Read two result topics from the beginning (no consumer group), production's\n"
        "(--baseline) and a candidate's, e.g. a shadow worker's (--candidate); join the\n"
        "results on their source (topic, partition, offset) and report, per output, top-1\n"
        "and top-k agreement (classifier-like outputs), the largest absolute difference and\n"
        "the mean cosine similarity; the requests whose status or error code differ; each\n"
        "side's latency percentiles per stage and model version; the join's coverage; with\n"
        "--label-key, each side's top-1 accuracy.\n"
        "Exit 0 every threshold met; 1 one not met (or the topics never went quiet); 2 usage\n"
        "or configuration errors, or topics that cannot be read.",
        compare.run,
        epilog="examples:\n"
        "  infer-worker compare --baseline infer.results --candidate infer.results.shadow\n"
        "  infer-worker compare --config worker.toml --baseline infer.results "
        "--candidate infer.results.shadow --min-top1 0.99 --min-coverage 0.99 "
        "--max-error-diff 0 --json compare.json",
    )  # fmt: skip
    compare.add_arguments(cmp)
    build = add_command(
        sub, "build-engine", "build a TensorRT plan, a torch program or an INT8/FP16 ONNX model",
        "Build a TensorRT plan from an ONNX model with one optimisation profile per GPU "
        "slot, at the given precision, cached under a key of the model, TensorRT version, "
        "GPU, precision and batch range. Needs TensorRT 10 (exit 2 without it). "
        "--backend torch exports a program (.pt2); --backend onnxruntime builds an INT8 "
        "(static quantization, calibrated on samples preprocessed as the worker serves "
        "them) or FP16 ONNX model for the CPU path, with a build record beside it.",
        build_engine_command,
    )  # fmt: skip
    build_engine.add_arguments(build)
