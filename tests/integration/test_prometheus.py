"""The shipped alert rules, run by a real Prometheus against a real worker (issue 23).

Prometheus (the binary Debian packages) scrapes a worker process on loopback
every second and evaluates deploy/prometheus/alerts.yaml every second; the test
reads back through Prometheus's HTTP API what an operator's stack would show.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import urllib.request
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import pytest
import yaml

from tests import required_tools
from tests.integration.test_pipeline import request_bytes
from tests.prometheus import Prometheus, config_here, rule_names
from worker.ops.broker import create_topics, free_port
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.topics import produce_all

pytestmark = pytest.mark.integration

REQUESTS = 20


class Broker(Protocol):
    """Whatever the ``broker`` fixture gives (the embedded broker or Kafka)."""

    @property
    def bootstrap(self) -> str: ...


def scrape_config_for(worker_port: int) -> dict[str, Any]:
    """The shipped config, pointed at one worker on loopback.

    Kept: the rule files (at their repository paths) and the infer-worker job's
    own settings (its relabelling). Changed, and why: the compose stack finds
    workers by DNS on compose service names, which do not resolve here, so the
    job scrapes the worker's address instead; kafka-exporter does not run here,
    so its job is dropped; scrape and evaluation run every second so the rules
    are evaluated within the test's deadline rather than after 15 s."""
    config = config_here()
    config["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "infer-worker"]
    del job["dns_sd_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{worker_port}"]}]
    config["scrape_configs"] = [job]
    return config


_COMPARISON = re.compile(r"==|!=|>=|<=|>|<")


def as_bool(expr: str) -> str:
    """``expr`` with its top-level comparison turned into a ``bool`` one: 0 or
    1 for every series the comparison matches, where the plain form returns
    only the series that pass. Empty means the alert could never fire: a
    series it reads is absent, or the two sides' labels do not match."""
    depth, quote, found = 0, "", []
    i = 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and (match := _COMPARISON.match(expr, i)):
            found.append(match)
            i = match.end()
            continue
        i += 1
    assert len(found) == 1, f"expected one top-level comparison in {expr!r}, found {found}"
    end = found[0].end()
    return f"{expr[:end]} bool{expr[end:]}"


def test_as_bool_finds_the_top_level_comparison_only() -> None:
    assert as_bool('a{x=~"b>c"} > 0.5 * rate(y[5m])') == 'a{x=~"b>c"} > bool 0.5 * rate(y[5m])'
    assert as_bool("infer_ready == 0") == "infer_ready == bool 0"
    with pytest.raises(AssertionError):
        as_bool("sum(a > 1)")


def alert_rules() -> list[dict[str, Any]]:
    rules = []
    for path in config_here()["rule_files"]:
        for group in yaml.safe_load(Path(path).read_text())["groups"]:
            rules += [r for r in group["rules"] if "alert" in r]
    return rules


async def test_prometheus_scrapes_a_worker_and_evaluates_every_shipped_rule(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    binary = required_tools.binary("prometheus")
    promtool = required_tools.binary("promtool")
    topics = {names["requests"]: 2, names["results"]: 1, names["dlq"]: 1}
    await create_topics(broker.bootstrap, topics)
    worker: WorkerProcess | None = None
    prometheus: Prometheus | None = None
    try:
        worker = spawn_worker(
            broker.bootstrap,
            input_topics=[names["requests"]],
            output_topic=names["results"],
            dlq_topic=names["dlq"],
            group_id=names["group"],
        )
        await asyncio.to_thread(
            worker.wait_until, lambda m: m.get("infer_ready") == 1, 60.0, "ready"
        )
        config = scrape_config_for(worker.metrics_port)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prometheus = Prometheus(
            binary,
            tmp_path / "prometheus.yml",
            tmp_path / "data",
            free_port(),
            tmp_path / "prometheus.log",
        )
        records = [(f"k{i}".encode(), request_bytes(i)) for i in range(REQUESTS)]
        await produce_all(broker.bootstrap, names["requests"], records)
        await asyncio.to_thread(check_prometheus, prometheus, config)
        await asyncio.to_thread(lint_exposition, promtool, worker.metrics_port)
    finally:
        if prometheus is not None:
            prometheus.stop()
        if worker is not None:
            assert worker.terminate() == 0, worker.log_tail()


def lint_exposition(promtool: str, port: int) -> None:
    """What Prometheus scraped also passes promtool's metric lint (names,
    suffixes, help texts)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        exposition = resp.read()
    lint = subprocess.run(
        [promtool, "check", "metrics"],
        input=exposition,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert lint.returncode == 0, (lint.stdout + lint.stderr).decode()


def evaluated_at(rule: dict[str, Any]) -> datetime:
    """A rule's lastEvaluation (RFC 3339 in nanoseconds; Python reads microseconds)."""
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", rule["lastEvaluation"]))


def check_prometheus(prometheus: Prometheus, config: dict[str, Any]) -> None:
    # The target is up: Prometheus reached the worker's /metrics and parsed it.
    targets = prometheus.wait_for(
        "the worker's target up",
        lambda: prometheus.api("targets")["activeTargets"],
        lambda ts: len(ts) == 1 and ts[0]["health"] == "up",
    )
    assert targets[0]["labels"]["job"] == "infer-worker"

    # The worker's series are stored, and follow its work.
    info = prometheus.wait_for(
        "infer_build_info stored", lambda: prometheus.query("infer_build_info"), bool
    )
    assert info[0]["metric"]["backend"] == "onnxruntime", info
    ready = prometheus.query("infer_ready")
    assert [r["value"][1] for r in ready] == ["1"], ready
    prometheus.wait_for(
        f"infer_records_consumed_total at {REQUESTS}",
        lambda: prometheus.query("infer_records_consumed_total"),
        lambda r: [v["value"][1] for v in r] == [str(REQUESTS)],
    )

    # Every shipped rule is loaded and was evaluated without an error, on the
    # series stored by now: an evaluation before the first scrape sees no data
    # and errs on nothing, so only one after this moment counts. (Wall clock:
    # Prometheus reports evaluation times in it, on this same machine.)
    since = datetime.now(UTC)

    def rules() -> list[dict[str, Any]]:
        return [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]

    loaded = prometheus.wait_for(
        "every rule evaluated on the stored series",
        rules,
        lambda rs: bool(rs) and all(evaluated_at(r) > since for r in rs),
    )
    assert {r["name"] for r in loaded} == rule_names(config)
    for rule in loaded:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
        # A healthy worker trips no alert, not even into pending.
        assert rule["type"] != "alerting" or rule["state"] == "inactive", rule

    # Each alert's condition evaluates to a value for this worker: the series
    # it reads exist and its sides match, so it can fire when the value turns.
    for rule in alert_rules():
        values = prometheus.wait_for(
            f"{rule['alert']}'s condition to evaluate",
            partial(prometheus.query, as_bool(rule["expr"])),
            bool,
            timeout=30.0,
        )
        assert {v["value"][1] for v in values} == {"0"}, (rule["alert"], values)
