"""``infer-worker topics check | create`` and ``produce`` on a real cluster (issue 56):
the topics a configuration needs are listed, created (compacted where they must
be), and a tool names a missing topic instead of blaming the broker; ``produce``
takes any worker configuration (lanes too) and builds a backlog or a stream."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.ops.broker import Broker, create_topics
from worker.ops.topics import Collector

pytestmark = pytest.mark.integration


def tool(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    return subprocess.run(
        [sys.executable, "-m", "worker", *args], env=env, capture_output=True, text=True,
        timeout=timeout, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def lanes_config(tmp: Path, broker: Broker, names: dict[str, str]) -> tuple[Path, str, str]:
    urgent, bulk = names["requests"] + ".urgent", names["requests"] + ".bulk"
    path = tmp / "lanes.toml"
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
        f'input_topics = ["{urgent}", "{bulk}"]\noutput_topic = "{names["results"]}"\n'
        f'dlq_topic = "{names["dlq"]}"\ncrash_guard_topic = "{names["guard"]}"\n'
        f'[[kafka.lanes]]\ntopics = ["{urgent}"]\n'
        f'[[kafka.lanes]]\ntopics = ["{bulk}"]\npriority = 1\n'
    )
    return path, urgent, bulk


async def test_topics_create_makes_what_check_finds_missing_then_produce_sends(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    config, urgent, bulk = lanes_config(tmp_path, broker, names)
    before = tool("topics", "check", "--config", str(config))
    assert before.returncode == 1, before.stderr
    for topic in (urgent, bulk, names["results"], names["dlq"], names["guard"]):
        assert any(topic in line and "MISSING" in line for line in before.stdout.splitlines())
    # A missing topic is named as such, not as a broker nothing answers at.
    missing = tool("produce", "--config", str(config), "--samples", "1", "--no-wait")
    assert missing.returncode == 2, missing.stderr
    assert f"kafka.input_topics: {urgent} not found on {broker.bootstrap}" in missing.stderr
    assert "no Kafka broker answers" not in missing.stderr
    assert "not found in cluster metadata" not in missing.stderr

    made = tool("topics", "create", "--config", str(config), "--partitions", "3")
    assert made.returncode == 0, made.stderr
    rows = {line.split()[0]: line for line in made.stdout.splitlines()}
    assert "3 partitions" in rows[urgent] and "3 partitions" in rows[names["results"]]
    assert "1 partition" in rows[names["dlq"]] and "1 partition" in rows[names["guard"]]
    after = tool("topics", "check", "--config", str(config))
    assert after.returncode == 0, after.stdout + after.stderr
    again = tool("topics", "create", "--config", str(config))  # existing ones are kept
    assert again.returncode == 0 and "created" not in again.stdout + again.stderr

    # produce takes the lanes configuration as the worker does (it rewrote
    # input_topics and refused it), sends to --topic, and cycles to --count.
    sent = tool("produce", "--config", str(config), "--topic", bulk, "--samples", "2",
                "--count", "500", "--no-wait")  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert "sent 500 requests" in sent.stderr
    typo = tool("produce", "--config", str(config), "--topic", bulk + "x", "--samples", "1",
                "--no-wait")  # fmt: skip
    assert typo.returncode == 2 and f"--topic: {bulk}x not found" in typo.stderr
    c = Collector(broker.bootstrap, [bulk])
    await c.start()
    try:
        assert await c.collect(lambda c: c.count() >= 500, 30.0)
        await c.collect(lambda c: False, 0.3)
    finally:
        await c.stop()
    ids = {r.headers.get("id") or r.record_key for r in c.records[bulk]}
    assert c.count() == 500 and len(ids) == 500  # each copy a request of its own


@pytest.mark.parametrize("broker_kind", ["kafka"])
async def test_topics_create_makes_the_changelog_compacted_and_co_partitioned(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    """A state changelog gets the input topic's partitions (an existing input
    topic's, whatever --partitions says) and cleanup.policy=compact; check names
    a changelog that is neither."""
    await create_topics(broker.bootstrap, {names["requests"]: 4})
    state = names["requests"] + ".state"
    config = tmp_path / "stateful.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
        f'input_topics = ["{names["requests"]}"]\noutput_topic = "{names["results"]}"\n'
        f'dlq_topic = "{names["dlq"]}"\nstate_topic = "{state}"\n'
        "[limits]\nmax_crash_attempts = 0\n"
    )
    made = tool("topics", "create", "--config", str(config), "--partitions", "2")
    assert made.returncode == 0, made.stderr
    rows = {line.split()[0]: line for line in made.stdout.splitlines()}
    assert "4 partitions" in rows[state] and "2 partitions" in rows[names["results"]]
    assert names["guard"] not in made.stdout  # protection off: no crash-guard topic needed
    bad = names["requests"] + ".bad-state"  # neither compacted nor co-partitioned
    await create_topics(broker.bootstrap, {bad: 2})
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(config.read_text().replace(state, bad))
    check = tool("topics", "check", "--config", str(wrong))
    assert check.returncode == 1
    line = next(x for x in check.stdout.splitlines() if x.startswith(bad))
    assert "cleanup.policy is" in line and "needs compact" in line and "co-partitioned" in line


def test_the_dev_kit_listens_where_it_is_told_and_says_where() -> None:
    """Issue 56: the dev kit's broker was on a random port while every example
    says localhost:9092; ``python -m devkit.apache_kafka`` takes a port (9092
    when free, by default) and prints the address and the variable to export."""
    import select
    import signal

    from tests.conftest import require_kafka
    from worker.ops.broker import free_port

    require_kafka()
    port = free_port(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
    kit = subprocess.Popen(
        [sys.executable, "-m", "devkit.apache_kafka", "--port", str(port)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert kit.stdout is not None
        ready, _, _ = select.select([kit.stdout], [], [], 180)  # Kafka starts, or fails
        assert ready, "the dev kit said nothing in 180 s"
        first = kit.stdout.readline()
        said = first + kit.stdout.readline()
        assert "ready in" in first and f"127.0.0.1:{port}" in first, said
        assert f"export INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS=127.0.0.1:{port}" in said
        check = tool("topics", "check", "--bootstrap-servers", f"127.0.0.1:{port}")
        assert check.returncode == 1 and "MISSING" in check.stdout, check.stderr  # it answers
    finally:
        kit.send_signal(signal.SIGTERM)
        kit.wait(60)
