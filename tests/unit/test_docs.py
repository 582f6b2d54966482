"""The documentation site's generated references (docs/hooks/reference.py): the
configuration reference lists every key of the configuration types with its
meaning (a key without one fails the build), the metrics reference every metric
with its labels, the command-line reference every command. ``make test`` builds
the site itself with ``mkdocs build --strict``."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


reference = _hook("reference")


@dataclasses.dataclass(frozen=True)
class _Section:
    # How many widgets a batch holds.
    widgets: int = 3
    colour: str = "blue"  # The colour of the widgets.


@dataclasses.dataclass(frozen=True)
class _Settings:
    kafka: _Section = dataclasses.field(default_factory=_Section)


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    kafka: _Section = dataclasses.field(default_factory=_Section)
    # A comment with a blank line after it documents nothing.

    shiny: bool = False


def test_a_key_added_to_the_configuration_types_is_in_the_reference() -> None:
    page = reference.configuration_md(_Settings)
    assert "| `widgets` | int | `3` | How many widgets" in page
    assert "a batch holds.<br>Environment: `INFER_WORKER_KAFKA__WIDGETS` |" in page
    assert "| `colour` | str | `'blue'` | The colour" in page
    with pytest.raises(reference.Undocumented, match="shiny"):
        reference.configuration_md(_Undocumented)


def test_every_key_of_the_worker_is_in_the_reference_with_its_meaning() -> None:
    from worker.config import KafkaConfig, Settings

    page = reference.configuration_md()  # raises if a key has no comment
    keys = list(reference.keys(Settings))
    assert len(keys) > 100 and all(k.meaning for k in keys)
    for f in dataclasses.fields(KafkaConfig):
        assert f"| `{f.name}` |" in page, f.name
        assert f"Environment: `INFER_WORKER_KAFKA__{f.name.upper()}` |" in page, f.name
    assert "| `lanes[].priority` | int |" in page
    assert "Environment: part of `INFER_WORKER_KAFKA__LANES` |" in page
    assert "Environment: `INFER_WORKER_MODEL__INPUTS__<NAME>__TOKENIZER` |" in page
    assert "| `memory_fraction` | float | `0.0` |" in page


def test_every_metric_and_every_command_is_in_its_reference() -> None:
    from prometheus_client.metrics import MetricWrapperBase

    from worker.cli import build_parser
    from worker.obs import metrics

    page = reference.metrics_md()
    for m in vars(metrics).values():
        if isinstance(m, MetricWrapperBase):
            assert f"`{m._name}" in page, m._name
    assert "| `infer_request_seconds` | histogram | `model`, `version`, `lane` |" in page
    cli = reference.cli_md()
    for command in ("run", "produce", "consume", "topics", "verify", "compare", "build-engine"):
        assert f"\n## infer-worker {command}\n" in cli, command
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert cli.count("usage: infer-worker") == 1 + len(sub.choices)


def test_the_repository_pages_carry_their_sources() -> None:
    repository = _hook("repository")
    example = repository.example_config_md()
    assert (ROOT / "worker.example.toml").read_text() in example
    bench = repository.benchmarks_md()
    assert "](" not in bench.replace("](#", "")  # links to repository files made plain
