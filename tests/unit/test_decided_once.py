"""Things decided once (issue 38), held by reading the source: an error code is
spelled only in its enum, the delivery guarantee compared only in the
configuration. Either check fails on the first place that decides it again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from worker.flow.codes import ErrorCode

WORKER = Path(__file__).resolve().parents[2] / "worker"


def _sources() -> list[Path]:
    return sorted(WORKER.rglob("*.py"))


def test_error_codes_are_spelled_only_in_their_enum() -> None:
    codes = {c.value for c in ErrorCode}
    found = []
    for path in _sources():
        if path == WORKER / "flow" / "codes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in codes:
                found.append(f"{path.relative_to(WORKER.parent)}:{node.lineno}: {node.value!r}")
    assert not found, "use ErrorCode (worker/flow/codes.py):\n" + "\n".join(found)


def test_the_guarantee_is_compared_only_in_the_configuration() -> None:
    compared = re.compile(r"processing_guarantee\s*[!=]=")
    found = [
        f"{path.relative_to(WORKER.parent)}:{i}"
        for path in _sources() if "config" not in path.relative_to(WORKER).parts
        for i, line in enumerate(path.read_text().splitlines(), 1) if compared.search(line)
    ]  # fmt: skip
    assert not found, "ask KafkaConfig.exactly_once:\n" + "\n".join(found)


def test_time_budgets_are_computed_only_by_the_deadline_module() -> None:
    """``time.monotonic() + x`` is a budget decided on the spot; ``Deadline``
    (worker/flow/deadline.py) is the one place (issue 38)."""
    budget = re.compile(r"monotonic\(\)\s*\+")
    found = [
        f"{path.relative_to(WORKER.parent)}:{i}"
        for path in _sources() if path != WORKER / "flow" / "deadline.py"
        for i, line in enumerate(path.read_text().splitlines(), 1) if budget.search(line)
    ]  # fmt: skip
    assert not found, "use worker.flow.deadline.Deadline:\n" + "\n".join(found)


def test_no_behaviour_is_decided_by_the_class_of_a_stage_or_writer() -> None:
    """What a stage or a writer does is asked of it (``Stage.sequences``,
    ``RunPlan.reloads``, the writer the plan built), never read off its class."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance"):
                continue
            for ref in ast.walk(node.args[1]):
                name = getattr(ref, "id", None) or getattr(ref, "attr", None) or ""
                if name.endswith(("Stage", "Writer")):
                    found.append(f"{path.relative_to(WORKER.parent)}:{node.lineno}: {name}")
    assert not found, "ask the stage or writer, not its class:\n" + "\n".join(found)
