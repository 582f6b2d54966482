"""The Apache Kafka recipe without starting it: the pinned version is the one
docker-compose.yml runs, the pom names the broker and a log4j2 binding, node
properties carry the test-only settings, and a missing tool is reported with
how to get it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from devkit import kafka_runtime
from devkit.kafka_runtime import KAFKA_VERSION, KafkaUnavailable, kafka_libs, pom
from devkit.kafka_settings import TEST_SETTINGS, cluster_id, server_properties

ROOT = Path(__file__).resolve().parents[3]


def test_compose_runs_the_kafka_version_the_tests_run() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    images = {s["image"] for s in services.values() if "apache/kafka" in s.get("image", "")}
    assert images == {f"apache/kafka:{KAFKA_VERSION}"}


def test_pom_names_the_broker_and_a_log4j2_binding_at_pinned_versions() -> None:
    text = pom()
    deps = re.findall(
        r"<groupId>([^<]+)</groupId><artifactId>([^<]+)</artifactId><version>([^<]+)</version>",
        text,
    )
    found = {(g, a): v for g, a, v in deps}
    assert found[("org.apache.kafka", "kafka_2.13")] == KAFKA_VERSION
    assert ("org.apache.logging.log4j", "log4j-slf4j2-impl") in found
    assert ("org.apache.logging.log4j", "log4j-core") in found
    assert found[("org.slf4j", "slf4j-api")].startswith("2.")


def test_cluster_ids_are_kraft_uuids() -> None:
    ids = {cluster_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", i) and not i.startswith("-") for i in ids)


@pytest.mark.parametrize(("size", "min_isr"), [(1, "1"), (3, "2")])
def test_node_properties_carry_the_test_settings_sized_to_the_cluster(
    size: int, min_isr: str, tmp_path: Path
) -> None:
    props = server_properties(2, 20000, 20001, "1@127.0.0.1:1,2@127.0.0.1:2", size, tmp_path)
    assert props["node.id"] == "2" and props["process.roles"] == "broker,controller"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:20000,CONTROLLER://127.0.0.1:20001"
    assert props["offsets.topic.replication.factor"] == str(size)
    assert props["transaction.state.log.replication.factor"] == str(size)
    assert props["transaction.state.log.min.isr"] == min_isr
    assert props["auto.create.topics.enable"] == "false"
    assert int(props["group.min.session.timeout.ms"]) <= 2000  # tests use 2-3 s sessions
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert all(props[k] == v for k, v in TEST_SETTINGS.items())


def test_missing_tools_are_reported_with_how_to_get_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFER_KAFKA_CACHE", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setattr(kafka_runtime.shutil, "which", lambda name: None)
    with pytest.raises(KafkaUnavailable, match="apt-get install openjdk-17-jre-headless maven"):
        kafka_libs("0.0.0-test")
