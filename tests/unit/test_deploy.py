"""docker-compose.yml and the Dockerfile cannot run here (no Docker engine), so
check what can be checked: the compose file parses, the worker's environment is a
valid configuration, the topics it needs are created, and the Dockerfile copies
files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from worker.config import load_settings

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_worker_environment_is_a_valid_config() -> None:
    env = {k: str(v) for k, v in compose()["services"]["worker"]["environment"].items()}
    settings = load_settings(ROOT / "worker.example.toml", env=env)
    assert settings.kafka.bootstrap_servers == "kafka:19092"
    assert settings.model.backend == "onnxruntime"


def test_topics_service_creates_the_worker_topics() -> None:
    services = compose()["services"]
    env = {k: str(v) for k, v in services["worker"]["environment"].items()}
    settings = load_settings(env=env)
    script = "\n".join(services["topics"]["command"])
    created = set(re.findall(r"([\w.]+):\d+", script))
    assert {
        *settings.kafka.input_topics,
        settings.kafka.output_topic,
        settings.kafka.dlq_topic,
    } <= created
    assert "infer.crash-guard" in script and "cleanup.policy=compact" in script


def test_kafka_runs_kraft_from_the_official_image() -> None:
    kafka = compose()["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert kafka["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_dockerfile_copies_existing_paths() -> None:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src


def test_a_configuration_error_does_not_restart_for_ever() -> None:
    """Exit 2 means the settings are wrong: a plain ``on-failure`` loops for ever."""
    restart = compose()["services"]["worker"]["restart"]
    assert restart.startswith("on-failure:") and int(restart.split(":")[1]) <= 5


def test_dockerignore_keeps_the_virtualenv_out_of_the_build_context() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored
