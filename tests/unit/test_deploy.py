"""docker-compose.yml, the Dockerfile and what the compose stack mounts from
deploy/ cannot run here (no Docker engine), so check what can be checked: the
compose file parses, every service's worker environment is a valid
configuration, the topics the workers need are created, Kafka keeps its data,
the GPU worker asks for a GPU and builds the Dockerfile's gpu stage, Prometheus
scrapes every worker and kafka-exporter and loads the alert rules, Grafana is
provisioned with the dashboard and the datasource that dashboard selects, every
file a service mounts exists, the producer runs a real CLI command, and the
Dockerfile copies files that exist."""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import yaml

from tests import required_tools
from worker.__main__ import build_parser
from worker.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "compose" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "infer-worker.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
GPU_BACKENDS = {"torch", "tensorrt"}


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def services() -> dict[str, Any]:
    return compose()["services"]  # type: ignore[no-any-return]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the "KEY=VALUE" form
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def worker_env(service: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in environment(service).items() if k.startswith("INFER_WORKER_")}


def settings_of(service: dict[str, Any]) -> Settings:
    """What the container runs with: the image's config file (worker.example.toml,
    copied to /etc/infer-worker/worker.toml) plus the service's environment."""
    return load_settings(ROOT / "worker.example.toml", env=worker_env(service))


def worker_services() -> dict[str, dict[str, Any]]:
    """Services that run the worker: the image's default command (`run`)."""
    return {
        name: svc
        for name, svc in services().items()
        if "build" in svc and "command" not in svc and "entrypoint" not in svc
    }


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (a host path, or a named volume)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            out[volume["target"]] = volume["source"]
        else:
            source, target = volume.split(":")[:2]
            out[target] = source
    return out


def is_host_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def mounted_from(service: dict[str, Any], container_path: str) -> Path:
    """The repository file or folder that ``container_path`` comes from (the
    mount itself, or a folder mounted above it)."""
    path = PurePosixPath(container_path)
    for target, source in mounts(service).items():
        if is_host_path(source) and (
            path == PurePosixPath(target) or PurePosixPath(target) in path.parents
        ):
            return ROOT / source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not mounted from the repository")


def dockerfile_stages() -> list[tuple[str, list[str]]]:
    """(name, instructions) per stage, in order; continuation lines joined."""
    stages: list[tuple[str, list[str]]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        words = line.split()
        if words[0].upper() == "FROM":
            name = words[3] if len(words) > 3 and words[2].upper() == "AS" else str(len(stages))
            stages.append((name, [line]))
        else:
            stages[-1][1].append(line)
    return stages


# --- compose: Kafka and topics ------------------------------------------------------


def test_compose_has_the_operator_stack_and_publishes_its_ports() -> None:
    svcs = services()
    assert {
        "kafka", "topics", "worker", "worker-gpu", "producer", "kafka-exporter",
        "prometheus", "grafana",
    } <= set(svcs)  # fmt: skip
    published = {str(port).split(":")[-2] for svc in svcs.values() for port in svc.get("ports", [])}
    assert {"9092", "9090", "3000"} <= published, published


def test_worker_environment_is_a_valid_config() -> None:
    settings = settings_of(services()["worker"])
    assert settings.kafka.bootstrap_servers == "kafka:19092"
    assert settings.model.backend == "onnxruntime"


def test_every_service_worker_environment_is_a_valid_configuration() -> None:
    """Unknown keys and bad values raise: a typo in any service fails here."""
    checked = {name: settings_of(svc) for name, svc in services().items() if worker_env(svc)}
    assert {"worker", "worker-gpu", "producer"} <= set(checked)
    workers = [checked[name] for name in worker_services()]
    # One consumer group, one set of topics, one broker: a GPU member and CPU
    # members share the partitions of the same input.
    groups = {(s.kafka.group_id, s.kafka.input_topics, s.kafka.output_topic) for s in workers}
    assert len(groups) == 1, groups
    assert len({s.kafka.bootstrap_servers for s in checked.values()}) == 1
    assert checked["producer"].kafka.input_topics == workers[0].kafka.input_topics


def test_topics_service_creates_the_worker_topics() -> None:
    svcs = services()
    settings = settings_of(svcs["worker"])
    script = "\n".join(svcs["topics"]["command"])
    created = set(re.findall(r"([\w.]+):\d+", script))
    assert {
        *settings.kafka.input_topics,
        settings.kafka.output_topic,
        settings.kafka.dlq_topic,
    } <= created
    assert settings.kafka.crash_guard_topic in script and "cleanup.policy=compact" in script


def test_kafka_runs_kraft_from_the_official_image() -> None:
    kafka = services()["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert kafka["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    advertised = kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert f"//{settings_of(services()['worker']).kafka.bootstrap_servers}" in advertised
    assert "//localhost:9092" in advertised


def test_kafka_keeps_its_data_on_a_named_volume_under_a_fixed_cluster_id() -> None:
    """A generated cluster id would not match the formatted volume after a
    recreate; the data directory must be the mounted volume, not /tmp."""
    doc = compose()
    env = doc["services"]["kafka"]["environment"]
    cluster_id = env["CLUSTER_ID"]
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16, "a base64 UUID (random-uuid)"
    source = mounts(doc["services"]["kafka"])[env["KAFKA_LOG_DIRS"]]
    assert not is_host_path(source) and source in doc["volumes"]


# --- compose: workers ---------------------------------------------------------------


def test_cpu_workers_are_replicas_of_one_group_without_a_shared_static_id() -> None:
    worker = services()["worker"]
    assert worker["deploy"]["replicas"] >= 2
    assert worker["build"]["target"] == "cpu"
    for name, svc in worker_services().items():
        replicas = svc.get("deploy", {}).get("replicas", 1)
        if replicas > 1:  # one environment for all: an instance id would not be unique
            assert settings_of(svc).kafka.group_instance_id == "", name


def healthcheck_url(service: dict[str, Any]) -> tuple[list[str], str, int, str]:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python" and test[2] == "-c", test
    assert not any("curl" in part or "wget" in part for part in test), "the images have neither"
    found = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/\w+)", test[3])
    assert found, test
    return test, test[3], int(found[1]), found[2]


def test_workers_expose_metrics_and_are_probed_on_their_health_endpoints() -> None:
    for name, svc in worker_services().items():
        settings = settings_of(svc)
        _, _, port, path = healthcheck_url(svc)
        assert port == settings.metrics.port, name
        assert path in {"/readyz", "/livez"}, name
        assert str(settings.metrics.port) in [str(p) for p in svc["expose"]], name
        # SIGTERM drains first: compose must not kill the worker before the deadline.
        grace = svc["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) > settings.shutdown.drain_timeout_ms / 1000


def test_a_configuration_error_does_not_restart_for_ever() -> None:
    """Exit 2 means the settings are wrong: a plain ``on-failure`` loops for ever."""
    for name, svc in worker_services().items():
        restart = svc["restart"]
        assert restart.startswith("on-failure:") and int(restart.split(":")[1]) <= 5, name


class _Status(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path in ("/readyz", "/livez") else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def status_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_healthcheck_command_fails_on_503_and_passes_on_200(
    status_server: ThreadingHTTPServer,
) -> None:
    """Run the probe's Python as Docker would, against a stand-in on loopback."""
    _, code, port, _ = healthcheck_url(services()["worker"])
    code = code.replace(f":{port}/", f":{status_server.server_address[1]}/")
    results = {}
    for status in (200, 503):
        _Status.status = status
        run = subprocess.run(
            [sys.executable, "-c", code], check=False, capture_output=True, timeout=30
        )
        results[status] = run.returncode
    assert results[200] == 0 and results[503] != 0, results


def test_gpu_worker_requests_a_gpu_and_builds_the_gpu_stage() -> None:
    gpu = services()["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["target"] == "gpu"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1
    assert "gpu" in device["capabilities"]
    settings = settings_of(gpu)
    assert settings.model.backend in GPU_BACKENDS
    assert settings.model.preprocess.device == "gpu"
    stages = dict(dockerfile_stages())
    assert "gpu" in stages
    base = stages["gpu"][0]
    assert base.split()[1].startswith("nvidia/cuda:") and "runtime" in base
    runs = " ".join(stages["gpu"])
    assert "[gpu,torch,registry]" in runs
    # The model it serves is not in the repository: the gpu stage must make it.
    assert not settings.model.path.startswith("builtin:")
    assert settings.model.path in runs, "the gpu stage does not write the model it serves"


def test_a_plain_docker_build_still_gives_the_cpu_image() -> None:
    stages = dockerfile_stages()
    name, instructions = stages[-1]
    assert name == "cpu" and instructions[0].split()[1].startswith("python:")
    assert all("nvidia" not in line and "torch" not in line for line in instructions)
    for svc in services().values():
        if "build" in svc and svc["build"]["target"] != "gpu":
            assert svc["build"]["target"] == "cpu"


def test_dockerfile_copies_existing_paths() -> None:
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src


def test_dockerignore_keeps_the_virtualenv_out_of_the_build_context() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored


# --- compose: producer --------------------------------------------------------------


def cli_invocations(script: str) -> list[list[str]]:
    """The arguments of every ``infer-worker`` command in a shell script, up to
    the next shell operator."""
    found = []
    for line in script.replace("$$", "$").splitlines():
        if line.lstrip().startswith("#") or "infer-worker" not in line:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        while "infer-worker" in tokens:
            rest = tokens[tokens.index("infer-worker") + 1 :]
            end = next((i for i, t in enumerate(rest) if set(t) <= set("();<>|&")), len(rest))
            found.append(rest[:end])
            tokens = rest[end:]
    return found


def test_the_producer_runs_a_real_cli_subcommand() -> None:
    producer = services()["producer"]
    assert producer["build"]["target"] == "cpu"
    assert producer["restart"] == "no"
    (argv,) = cli_invocations("\n".join(producer["command"]))
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"infer-worker {shlex.join(argv)}: not a valid command line")
    assert args.command == "produce"
    assert args.samples > 0 and not args.files
    assert args.no_wait  # sending only: each round must not wait out --timeout
    assert args.topic is None  # the workers' input topic, from the environment


def test_cli_invocations_stops_at_shell_operators() -> None:
    script = "if quiet infer-worker produce --samples 3 --no-wait; then n=$$((n + 1)); fi"
    assert cli_invocations(script) == [["produce", "--samples", "3", "--no-wait"]]


# --- compose: Prometheus, kafka-exporter, Grafana -----------------------------------


def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load(PROMETHEUS.read_text())  # type: ignore[no-any-return]


def test_every_host_path_a_service_mounts_exists() -> None:
    doc = compose()
    checked = 0
    for name, svc in doc["services"].items():
        for target, source in mounts(svc).items():
            if is_host_path(source):
                assert (ROOT / source).exists(), f"{name}: {source} -> {target}"
                checked += 1
            else:
                assert source in doc["volumes"], f"{name}: volume {source} is not declared"
    assert checked >= 5


def test_prometheus_loads_the_compose_config_and_the_alert_rules() -> None:
    prometheus = services()["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:")
    # The image's default --config.file, unless the command names another.
    command = " ".join(prometheus.get("command", []))
    found = re.search(r"--config\.file=(\S+)", command)
    config_path = found[1] if found else "/etc/prometheus/prometheus.yml"
    assert mounted_from(prometheus, config_path) == PROMETHEUS
    rule_files = prometheus_config()["rule_files"]
    assert rule_files
    for rule_file in rule_files:
        assert mounted_from(prometheus, rule_file) == ALERTS


def test_prometheus_scrapes_every_worker_on_the_metrics_port_and_kafka_exporter() -> None:
    svcs = services()
    jobs = prometheus_config()["scrape_configs"]
    discovered: dict[str, int] = {}
    static: set[str] = set()
    for job in jobs:
        for sd in job.get("dns_sd_configs", []):
            assert sd.get("type", "SRV") == "A", "Docker's DNS answers A records"
            discovered |= dict.fromkeys(sd["names"], sd["port"])
        for sc in job.get("static_configs", []):
            static |= set(sc["targets"])
    for name, svc in worker_services().items():
        assert discovered.get(name) == settings_of(svc).metrics.port, name
    exporter = svcs["kafka-exporter"]
    assert exporter["image"].startswith("danielqsj/kafka-exporter:")
    assert "kafka-exporter:9308" in static
    bootstrap = settings_of(svcs["worker"]).kafka.bootstrap_servers
    assert f"--kafka.server={bootstrap}" in exporter["command"]


def grafana_provisioning(kind: str) -> list[dict[str, Any]]:
    """The provisioning files Grafana reads for ``kind`` (datasources, dashboards)."""
    folder = mounted_from(services()["grafana"], f"/etc/grafana/provisioning/{kind}")
    files = sorted(folder.glob("*.y*ml"))
    assert files, folder
    return [yaml.safe_load(f.read_text()) for f in files]


def test_grafana_provisions_the_dashboard_file() -> None:
    grafana = services()["grafana"]
    assert grafana["image"].startswith("grafana/grafana:")
    (doc,) = grafana_provisioning("dashboards")
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    folder = provider["options"]["path"]
    dashboards = [t for t in mounts(grafana) if PurePosixPath(t).parent == PurePosixPath(folder)]
    assert [mounted_from(grafana, t) for t in dashboards] == [DASHBOARD]
    home = environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounted_from(grafana, home) == DASHBOARD
    # Viewers need no login: `docker compose up`, then http://localhost:3000.
    assert environment(grafana)["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert environment(grafana)["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_the_dashboard_uses_the_provisioned_prometheus() -> None:
    datasources = [ds for doc in grafana_provisioning("datasources") for ds in doc["datasources"]]
    (prometheus,) = [ds for ds in datasources if ds["type"] == "prometheus"]
    assert prometheus["url"] == "http://prometheus:9090" and "prometheus" in services()
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        ref = panel["datasource"]
        assert ref["type"] == "prometheus", panel["title"]
        uid = ref["uid"]
        if variable := re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", uid):
            var = variables[variable[1] or variable[2]]
            assert var["type"] == "datasource" and var["query"] == "prometheus"
            uid = var["current"]["value"]
        assert uid == prometheus["uid"], panel["title"]
        for target in panel["targets"]:  # a target's own datasource would override
            assert target.get("datasource", ref) == ref, panel["title"]


# --- the GPU image's model ----------------------------------------------------------


def digits_torchscript() -> ModuleType:
    path = ROOT / "scripts" / "digits_torchscript.py"
    spec = importlib.util.spec_from_file_location("digits_torchscript", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_image_model_conversion_reads_the_weights_onnxruntime_runs() -> None:
    """The weights the TorchScript model is built from, in its layout, compute
    what ONNX Runtime computes (without torch: the same layers in NumPy)."""
    pytest.importorskip("onnx")
    from worker.model.files import resolve_model_path

    convert = digits_torchscript()
    layers = convert.mlp_layers(resolve_model_path("builtin:digits"))
    x, labels = convert.held_out_batch()
    logits = convert.numpy_forward(layers, x)
    convert.check_against_onnxruntime(logits, convert.onnxruntime_logits(x))
    assert float(np.mean(logits.argmax(axis=1) == labels)) > 0.95


def test_the_gpu_image_model_conversion_writes_a_torchscript_equal_to_onnxruntime(
    tmp_path: Path,
) -> None:
    pytest.importorskip("onnx")
    required_tools.module("torch", required_tools.TORCH_INSTALL)
    out = tmp_path / "digits.pt"
    assert digits_torchscript().main([str(out)]) == 0
    assert out.stat().st_size > 0


def test_the_secured_override_merges_into_a_valid_secured_worker() -> None:
    """deploy/compose/secured.yml over the worker service: a valid configuration
    whose secrets are files Compose mounts, never values in the environment."""
    override = yaml.safe_load((ROOT / "deploy" / "compose" / "secured.yml").read_text())
    worker = services()["worker"]
    extra = override["services"]["worker"]["environment"]
    merged = {**worker, "environment": {**environment(worker), **extra}}
    settings = settings_of(merged)
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert settings.kafka.sasl_plain_password is None
    mounted = {f"/run/secrets/{name}" for name in override["services"]["worker"]["secrets"]}
    assert {settings.kafka.sasl_plain_password_file, settings.kafka.ssl_cafile} == mounted
    assert set(override["secrets"]) == set(override["services"]["worker"]["secrets"])


def test_the_shadow_override_is_a_shadow_of_the_worker_service() -> None:
    override = yaml.safe_load((ROOT / "deploy" / "compose" / "shadow.yml").read_text())
    svc = override["services"]["worker-shadow"]
    assert svc["extends"]["service"] == "worker"
    worker = services()["worker"]
    merged = {**worker, "environment": {**environment(worker), **svc["environment"]}}
    shadow, prod = settings_of(merged), settings_of(worker)
    assert shadow.kafka.shadow and shadow.kafka.input_topics == prod.kafka.input_topics
    assert shadow.kafka.group_id != prod.kafka.group_id
    assert shadow.kafka.output_topic != prod.kafka.output_topic
