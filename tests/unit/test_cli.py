"""The command line a person reads (issue 12): every example in ``--help`` and in
the README parses; every command and option says what it does."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from tests.documentation import documentation
from worker.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
_COMMAND = re.compile(r"^\s*(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?infer-worker\s+(.*?)\s*(?:#.*)?$")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_texts() -> list[str]:
    parser = build_parser()
    return [parser.format_help()] + [p.format_help() for p in _subparsers(parser).values()]


def _examples(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        found = _COMMAND.match(line)
        if found and found.group(1):
            # Columns of prose after two spaces are descriptions, not arguments.
            out.append(re.split(r"\s{2,}", found.group(1))[0])
    return out


def _readme_examples() -> list[str]:
    text = documentation()
    blocks = re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, re.S)
    return [e for block in blocks for e in _examples(block)]


HELP_EXAMPLES = sorted({e for text in _help_texts() for e in _examples(text)})
README_EXAMPLES = sorted(set(_readme_examples()))


def test_there_are_examples_to_check() -> None:
    assert len(HELP_EXAMPLES) >= 10 and len(README_EXAMPLES) >= 3


@pytest.mark.parametrize("example", HELP_EXAMPLES + README_EXAMPLES)
def test_every_example_parses(example: str) -> None:
    args = build_parser().parse_args(shlex.split(example.replace("\\", "")))
    assert callable(args.func)


def test_every_command_and_option_is_described() -> None:
    parser = build_parser()
    top = parser.format_help()
    assert "asyncio" not in top and "import time" not in top
    for name, sub in _subparsers(parser).items():
        assert sub.description, f"{name} has no description"
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help"


def test_demo_and_bench_help_differ_and_run_help_states_defaults_and_exit_codes() -> None:
    subs = _subparsers(build_parser())
    assert subs["demo"].format_help() != subs["bench"].format_help()
    run = subs["run"].format_help()
    assert "Without --config" in run and "exit status" in run
