"""The README's newcomer path, verbatim (issue 12): ``run --embedded``, then the
Python client example from the README, twice, each run answered with its own
image's answer (an earlier answer on the topic is never taken for it); then the
``produce`` and ``consume`` commands against the same worker."""

from __future__ import annotations

import asyncio
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from devkit.apache_kafka import KafkaCluster
from tests.documentation import documentation
from tests.images import encode
from worker.bench.demo import labelled_samples
from worker.ops.broker import create_topics
from worker.ops.processes import spawn_worker

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def readme_example(name: str) -> str:
    text = documentation()
    marker = text.index(f"<!-- example: {name}")
    start = text.index("```python\n", marker) + len("```python\n")
    return text[start : text.index("```\n", start)]


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[str]:
    """``infer-worker run --embedded`` as a user starts it; yields its bootstrap."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    env["INFER_WORKER_METRICS__PORT"] = "0"  # CI may run other workers on this host
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "run", "--embedded", "--partitions", "2"],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline, lines = time.monotonic() + 60, []
    bootstrap = None
    while bootstrap is None and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            line = proc.stderr.readline()
            lines.append(line)
            found = re.match(r"embedded broker on (localhost:\d+)", line)
            bootstrap = found.group(1) if found else None
        assert proc.poll() is None, "".join(lines)
    assert bootstrap, "".join(lines)
    try:
        yield bootstrap
    finally:
        proc.terminate()
        proc.wait(30)
        assert proc.returncode == 0


def _digit_file(tmp_path: Path, index: int, fmt: str) -> tuple[Path, int]:
    sample = labelled_samples(1)[index]
    big = np.kron(sample.image, np.ones((4, 4, 1), np.uint8))  # 32x32: the worker resizes
    path = tmp_path / f"digit{index}.{fmt.lower()}"
    path.write_bytes(encode(big, fmt, **({"quality": 95} if fmt == "JPEG" else {})))
    return path, sample.label


def test_readme_client_example_twice_then_produce_and_consume(
    embedded: str, tmp_path: Path
) -> None:
    client_paths(embedded, tmp_path)


def test_readme_client_example_and_produce_consume_on_kafka(
    kafka_broker: KafkaCluster, tmp_path: Path
) -> None:
    """The same against Apache Kafka, with the README's topic names (only this
    test uses them on the session's Kafka) and a worker started as an operator would."""
    asyncio.run(
        create_topics(
            kafka_broker.bootstrap, {"infer.requests": 2, "infer.results": 2, "infer.dlq": 1}
        )
    )
    w = spawn_worker(
        kafka_broker.bootstrap,
        input_topics=["infer.requests"],
        output_topic="infer.results",
        dlq_topic="infer.dlq",
        group_id="infer-worker",
    )
    try:
        w.wait_until(lambda m: m.get("infer_assigned_partitions", 0) >= 2, 60.0, "assignment")
        client_paths(kafka_broker.bootstrap, tmp_path)
        assert w.terminate() == 0, w.log_tail()
    finally:
        w.kill()


def client_paths(bootstrap: str, tmp_path: Path) -> None:
    """The README's client example twice, then ``produce`` and ``consume``."""
    script = tmp_path / "client.py"
    script.write_text(readme_example("client.py"))
    env = {**os.environ, "KAFKA_BOOTSTRAP": bootstrap}
    # Two different digits, one after the other: the second run must print the
    # second digit's answer, not the first one's (still on the topic).
    for index, fmt in ((2, "PNG"), (0, "JPEG")):
        image, label = _digit_file(tmp_path, index, fmt)
        proc = subprocess.run(
            [sys.executable, str(script), str(image)],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        rid, status, rest = proc.stdout.split(" ", 2)
        assert rid.startswith(image.name) and status == "ok", proc.stdout
        assert rest.startswith(f"[{label},"), (label, proc.stdout)

    cli = [sys.executable, "-m", "worker"]
    flags = ["--bootstrap-servers", bootstrap]
    image, label = _digit_file(tmp_path, 3, "PNG")
    produced = subprocess.run(
        [*cli, "produce", str(image), "--samples", "2", *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert produced.returncode == 0, produced.stderr
    answers = produced.stdout.strip().splitlines()
    assert len(answers) == 3 and all(" ok  top: " in a for a in answers), produced.stdout
    mine = next(a for a in answers if a.startswith(image.stem))
    assert mine.split("top: ")[1].startswith(f"{label} ("), mine

    wanted = mine.split()[0]
    consumed = subprocess.run(
        [*cli, "consume", "--id", wanted, "--timeout", "20", *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert consumed.returncode == 0, consumed.stderr
    assert consumed.stdout.strip() == mine
