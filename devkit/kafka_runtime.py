"""Apache Kafka's broker from Maven Central: the pinned version, fetched once.

Kafka publishes its broker as ``org.apache.kafka:kafka_2.13``; a runtime
classpath is that artifact with its dependencies plus a log4j2 binding. This
module writes a pom naming exactly those (from the version constants below: the
one place the tested Kafka version is pinned) and has Maven copy the jars into
a cache directory outside the checkout, once; later calls reuse it.

The cache is ``$INFER_KAFKA_CACHE`` when set, else
``${XDG_CACHE_HOME:-~/.cache}/infer-worker``, holding ``kafka-<version>/libs``.
(Not an ``INFER_WORKER_*`` name: those are configuration overrides, and the
worker refuses any it does not know.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from worker.ops.broker import BrokerError

# The Kafka version the tests run against; docker-compose.yml's apache/kafka
# image carries the same (tests/unit/devkit/test_apache_kafka.py checks).
KAFKA_VERSION = "4.4.0"
# Kafka's log4j2 binding. Kafka 4.x's pom pulls slf4j-api 1.7, which the
# slf4j2 binding does not serve: slf4j-api 2 is named explicitly (its 1.x
# callers keep working) so the broker's log goes to log4j2, not nowhere.
LOG4J_VERSION = "2.26.1"
SLF4J_VERSION = "2.0.17"

INSTALL_HINT = (
    "Apache Kafka tests need Java 17+ and Maven (Debian/Ubuntu: "
    "apt-get install openjdk-17-jre-headless maven) and access to Maven Central"
)


class KafkaUnavailable(BrokerError):
    """Kafka's runtime cannot be had here: no ``java``, no ``mvn``, or the
    fetch from Maven Central failed. The message says which and what to do."""

    code = "kafka_unavailable"


def cache_root() -> Path:
    explicit = os.environ.get("INFER_KAFKA_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infer-worker"


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise KafkaUnavailable(f"no java on PATH. {INSTALL_HINT}")
    return found


def pom(version: str = KAFKA_VERSION) -> str:
    """The Maven project whose runtime dependencies are the broker's classpath."""
    deps = [
        ("org.apache.kafka", "kafka_2.13", version),
        ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-slf4j2-impl", LOG4J_VERSION),
        ("org.slf4j", "slf4j-api", SLF4J_VERSION),
    ]
    lines = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency>"
        for g, a, v in deps
    )
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by devkit/kafka_runtime.py: Apache Kafka {version}'s broker classpath. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>infer-worker</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
{lines}
  </dependencies>
</project>
"""


def kafka_libs(version: str = KAFKA_VERSION, timeout: float = 900.0) -> Path:
    """The directory of Kafka ``version``'s runtime jars, fetched on first use.

    A fetch runs Maven under a lock file (concurrent callers wait for one fetch)
    into a temporary directory renamed into place when complete, so a fetch cut
    short never leaves a partial classpath behind."""
    home = cache_root() / f"kafka-{version}"
    libs = home / "libs"
    if (libs / ".complete").is_file():
        return libs
    java_binary()  # fail early, with the hint, where Java is missing
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaUnavailable(f"no mvn on PATH. {INSTALL_HINT}")
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home / ".lock"):
        if (libs / ".complete").is_file():
            return libs
        (home / "pom.xml").write_text(pom(version))
        staging = home / "libs.partial"
        shutil.rmtree(staging, ignore_errors=True)
        log = home / "mvn.log"
        t0 = time.monotonic()
        try:
            with open(log, "wb") as out:
                done = subprocess.run(
                    [
                        mvn, "-q", "-B", "-f", str(home / "pom.xml"),
                        "dependency:copy-dependencies", "-DincludeScope=runtime",
                        f"-DoutputDirectory={staging}",
                    ],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    timeout=timeout, check=False,
                )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise KafkaUnavailable(
                f"fetching Kafka {version} with Maven took over {timeout:.0f}s; log: {log}"
            ) from exc
        jars = list(staging.glob("kafka_2.13-*.jar")) if staging.is_dir() else []
        if done.returncode != 0 or not jars:
            tail = log.read_text(errors="replace")[-2000:]
            raise KafkaUnavailable(
                f"fetching Kafka {version} with Maven failed (exit {done.returncode}); "
                f"log: {log}\n{tail}\n{INSTALL_HINT}"
            )
        (staging / ".complete").write_text(f"fetched in {time.monotonic() - t0:.1f}s\n")
        shutil.rmtree(libs, ignore_errors=True)
        staging.rename(libs)
    return libs


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
