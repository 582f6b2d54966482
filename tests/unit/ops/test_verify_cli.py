"""``infer-worker verify``'s command line: defaults, usage errors, settings from a
config file and the environment, read_committed for exactly-once workers, exit
codes. The rules it applies are test_verify.py's."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from worker.kafka.credentials import Connection
from worker.ops.topics import TopicUnreadable
from worker.ops.verify import InputRecord, Reply, add_arguments, run


def bootstrap_of(c: Connection) -> str:
    """The bootstrap servers a reader was given (a string, or connection arguments)."""
    return c if isinstance(c, str) else str(c["bootstrap_servers"])


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="infer-worker verify")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_defaults() -> None:
    args = parse()
    assert args.config is None and args.bootstrap_servers is None
    assert args.idle_timeout == 2.0 and args.timeout == 60.0
    assert args.strict is False and args.json is None


@pytest.mark.parametrize(
    "argv",
    [
        ("--idle-timeout", "0"),
        ("--timeout", "-1"),
        ("--input-topics", " , "),
        ("--input-topics", "a,b", "--output-topic", "b"),
        ("--config", "/nonexistent/worker.toml"),
    ],
)
def test_cli_usage_errors_exit_2_before_touching_kafka(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    # The bootstrap address is unreachable: exit 2 must come from validation.
    assert run(parse("--bootstrap-servers", "127.0.0.1:1", *argv)) == 2
    assert "configuration error" in capsys.readouterr().err


def test_cli_config_file_supplies_topics_and_flags_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.ops import verify as verify_module
    from worker.ops.verify import cli as verify_cli

    for name in [n for n in os.environ if n.startswith("INFER_WORKER_")]:
        monkeypatch.delenv(name)
    cfg = tmp_path / "worker.toml"
    cfg.write_text(
        '[kafka]\nbootstrap_servers = "cfg:9092"\ninput_topics = ["x", "y"]\n'
        'output_topic = "x.out"\ndlq_topic = "x.dlq"\n'
    )
    seen: dict[str, object] = {}

    async def fake_read(
        bootstrap: str, inputs: list[str], output: str, dlq: str, **kw: object
    ) -> object:
        seen.update(bootstrap=bootstrap_of(bootstrap), inputs=list(inputs), output=output,
                    dlq=dlq, **kw)  # fmt: skip
        return {"x": {0: [0]}, "y": {}}, verify_module.Observed(
            (Reply(InputRecord("x", 0, 0), 0, 0, "result"),), (), True
        )

    monkeypatch.setattr(verify_cli, "read_topics", fake_read)
    out = tmp_path / "report.json"
    code = run(
        parse(
            "--config",
            str(cfg),
            "--dlq-topic",
            "other.dlq",
            "--json",
            str(out),
            "--idle-timeout",
            "0.5",
        )
    )
    assert code == 0
    assert seen == {
        "bootstrap": "cfg:9092",
        "inputs": ["x", "y"],
        "output": "x.out",
        "dlq": "other.dlq",
        "idle_timeout": 0.5,
        "timeout": 60.0,
        "isolation_level": "read_uncommitted",  # the config runs at-least-once
        "registry": None,  # no schema_registry.url: results are msgpack or JSON
    }
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["complete"] is True
    assert doc["topics"] == {
        "bootstrap_servers": "cfg:9092",
        "input": ["x", "y"],
        "output": "x.out",
        "dlq": "other.dlq",
    }
    assert capsys.readouterr().out.splitlines()[-1].startswith("OK: 1 requests")


def test_cli_defaults_come_from_kafka_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.config import KafkaConfig
    from worker.ops import verify as verify_module
    from worker.ops.verify import cli as verify_cli

    seen: list[tuple[str, list[str], str, str]] = []

    async def fake_read(
        bootstrap: str, inputs: list[str], output: str, dlq: str, **kw: float
    ) -> object:
        seen.append((bootstrap_of(bootstrap), list(inputs), output, dlq))
        return {}, verify_module.Observed((), (), True)

    monkeypatch.setattr(verify_cli, "read_topics", fake_read)
    assert run(parse()) == 0
    k = KafkaConfig()
    assert seen == [(k.bootstrap_servers, list(k.input_topics), k.output_topic, k.dlq_topic)]


def test_cli_reads_committed_transactions_when_asked_or_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker running exactly-once writes answers in transactions: its clients
    read them read_committed, and so does the verifier, by flag or because the
    configuration it reads runs exactly-once."""
    from worker.ops import verify as verify_module
    from worker.ops.verify import cli as verify_cli

    for name in [n for n in os.environ if n.startswith("INFER_WORKER_")]:
        monkeypatch.delenv(name)
    levels: list[object] = []

    async def fake_read(
        bootstrap: str, inputs: list[str], output: str, dlq: str, **kw: object
    ) -> object:
        levels.append(kw["isolation_level"])
        return {}, verify_module.Observed((), (), True)

    monkeypatch.setattr(verify_cli, "read_topics", fake_read)
    cfg = tmp_path / "worker.toml"
    cfg.write_text('[kafka]\nprocessing_guarantee = "exactly-once"\ngroup_instance_id = "w1"\n')
    assert run(parse()) == 0
    assert run(parse("--read-committed")) == 0
    assert run(parse("--config", str(cfg))) == 0
    assert levels == ["read_uncommitted", "read_committed", "read_committed"]


@pytest.mark.parametrize(
    ("observed_answers", "strict", "complete", "expected"),
    [
        ([0, 1], False, True, 0),
        ([0], False, True, 1),  # lost
        ([0, 1, 1], False, True, 0),  # duplicate tolerated
        ([0, 1, 1], True, True, 1),  # duplicate fails under --strict
        ([0, 1], False, False, 1),  # topics never went quiet: no verdict
    ],
)
def test_cli_exit_codes(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    observed_answers: list[int],
    strict: bool,
    complete: bool,
    expected: int,
) -> None:
    from worker.ops import verify as verify_module
    from worker.ops.verify import cli as verify_cli

    async def fake_read(*a: object, **kw: object) -> object:
        answers = tuple(
            Reply(InputRecord("in", 0, o), 0, i, "result") for i, o in enumerate(observed_answers)
        )
        return {"in": {0: [0, 1]}}, verify_module.Observed(answers, (), complete)

    monkeypatch.setattr(verify_cli, "read_topics", fake_read)
    argv = ["--input-topics", "in", "--json", "-"]
    if strict:
        argv.append("--strict")
    assert run(parse(*argv)) == expected
    doc = json.loads(capsys.readouterr().out)
    assert doc["complete"] is complete


def test_cli_unreadable_topics_are_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.ops.verify import cli as verify_cli

    async def failing_read(*a: object, **kw: object) -> object:
        raise TopicUnreadable("cannot read topic in: it has no partitions")

    monkeypatch.setattr(verify_cli, "read_topics", failing_read)
    assert run(parse("--input-topics", "in")) == 2
    assert "configuration error: cannot read topic in" in capsys.readouterr().err
