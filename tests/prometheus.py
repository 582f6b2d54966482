"""The shipped Prometheus config and rules, run by the real Prometheus here.

deploy/compose/prometheus.yml is what operators mount into the compose stack;
it names its rule files by their path inside the container, which does not
exist on this machine. ``config_here`` rewrites only those paths, to the
repository files docker-compose.yml mounts there, so promtool and Prometheus
read the shipped rules; the shipped file stays the one operators use.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.unit.test_deploy import PROMETHEUS, mounted_from, services

T = TypeVar("T")


def config_here() -> dict[str, Any]:
    """The shipped config with its rule files at their repository paths."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS.read_text())
    prometheus = services()["prometheus"]
    config["rule_files"] = [str(mounted_from(prometheus, f)) for f in config["rule_files"]]
    return config


def rule_names(config: dict[str, Any]) -> set[str]:
    """Every alerting and recording rule the config's rule files define."""
    names = set()
    for path in config["rule_files"]:
        for group in yaml.safe_load(Path(path).read_text())["groups"]:
            names |= {rule.get("alert") or rule["record"] for rule in group["rules"]}
    return names


class Prometheus:
    """A ``prometheus`` server process on loopback, with its HTTP API.

    ``stop`` is idempotent and kills what does not exit on SIGTERM: a failed
    or timed-out test leaves nothing running."""

    def __init__(self, binary: str, config: Path, storage: Path, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={storage}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])

    def api(self, path: str, **params: str) -> Any:
        """``data`` of a ``/api/v1/PATH`` answer (raises on an error status)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}{query}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant vector: [{"metric": {...}, "value": [ts, "v"]}, ...]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]  # type: ignore[no-any-return]

    def wait_for(
        self, what: str, fetch: Callable[[], T], done: Callable[[T], bool], timeout: float = 60.0
    ) -> T:
        """Poll ``fetch()`` until ``done`` holds for what it returned: what
        Prometheus scrapes and evaluates is only observable through its API."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"prometheus exited with {self.proc.returncode} waiting for {what}:\n"
                    + self.log_tail()
                )
            try:
                state = fetch()
            except OSError as exc:  # not listening yet (URLError is an OSError)
                last = exc
            else:
                if done(state):
                    return state
                last = state
            time.sleep(0.2)
        raise AssertionError(
            f"prometheus: {what} not reached in {timeout}s (last: {last!r})\n" + self.log_tail()
        )
