"""deploy/ is for operators (issue 13). Docker and Kubernetes do not run here,
so the files are checked by the tools that do: promtool checks the Prometheus
config and rules as Prometheus loads them (tests/integration/test_prometheus.py
runs them), the Kubernetes manifests validate against the API's schemas
(kubernetes-validate, offline), every metric a rule or a panel queries is one
the worker exports, every environment variable is a setting, and the grace
period outlasts the drain."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests import required_tools
from tests.prometheus import config_here
from worker.config import load_settings
from worker.obs import metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"


def exported_metric_names() -> set[str]:
    from prometheus_client.metrics import MetricWrapperBase

    names = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                base = family.name
                names |= {base, f"{base}_total", f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names


def queried(expr: str) -> set[str]:
    return set(re.findall(r"\b(infer_[a-z0-9_]+)", expr))


def test_rules_and_dashboard_query_only_exported_metrics() -> None:
    exported = exported_metric_names()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "infer-worker.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set().union(*(queried(e) for e in exprs))
    assert used and used <= exported, sorted(used - exported)


def test_the_dashboard_s_model_selector_filters_every_per_model_series() -> None:
    """Several models in one worker: each panel over a metric with ``model`` and
    ``version`` labels shows the models the selector picks."""
    from prometheus_client.metrics import MetricWrapperBase

    per_model = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase) and {"model", "version"} <= set(
            value._labelnames
        ):
            base = value.describe()[0].name
            per_model |= {base, f"{base}_total", f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    dashboard = json.loads((DEPLOY / "grafana" / "infer-worker.json").read_text())
    (selector,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert selector["definition"] == "label_values(infer_build_info, model)"
    assert selector["includeAll"] and selector["allValue"] == ".*"
    filtered = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in queried(target["expr"]) & per_model:
                assert f'{name}{{model=~"$model"}}' in target["expr"], (panel["title"], name)
                filtered += 1
    assert filtered >= 8


def test_deployment_env_is_valid_configuration_and_grace_outlasts_the_drain() -> None:
    deployment = yaml.safe_load((DEPLOY / "kubernetes" / "worker.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value", "pod-0") for e in container["env"]}
    settings = load_settings(env=env)  # unknown keys or bad values raise
    assert settings.kafka.group_instance_id == "pod-0"
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown.drain_timeout_ms / 1000
    paths = {container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")}
    assert paths == {"/livez", "/readyz"}


def keda_triggers() -> dict[str, dict[str, str]]:
    scaled = yaml.safe_load((DEPLOY / "kubernetes" / "keda-scaledobject.yaml").read_text())
    triggers = scaled["spec"]["triggers"]
    by_type = {t["type"]: t["metadata"] for t in triggers}
    assert len(by_type) == len(triggers), "one trigger of each type"
    return by_type


def test_keda_lag_threshold_is_above_the_inflight_window() -> None:
    inflight = load_settings(env={}).batching.max_inflight_records
    assert int(keda_triggers()["kafka"]["lagThreshold"]) > inflight


def test_keda_scales_on_a_served_model_s_seconds_to_drain() -> None:
    """The Prometheus trigger reads a series the worker serves, labelled as it
    labels it (the default model's name), summed over the members (each reports
    its own partitions' seconds: the sum is what KEDA's AverageValue target
    divides by the threshold), with a threshold that outlasts the signal's own
    refresh (the lag poll)."""
    from worker.config.models import served

    trigger = keda_triggers()["prometheus"]
    settings = load_settings(env={})
    query = re.fullmatch(r'sum\((\w+)\{model="([^"]+)"\}\)', trigger["query"])
    assert query is not None, trigger["query"]
    assert query[1] == metrics.SECONDS_TO_DRAIN._name == "infer_seconds_to_drain"
    assert metrics.SECONDS_TO_DRAIN._labelnames == ("model",)
    assert query[2] in {m.name for m in served(settings)}
    assert "metricType" not in trigger  # KEDA's default, AverageValue: what sum() is for
    assert float(trigger["threshold"]) >= 2 * settings.metrics.lag_interval_ms / 1000
    assert trigger["ignoreNullValues"] == "true"


# --- checked by the real tools --------------------------------------------------


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [required_tools.binary("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_promtool_accepts_the_alert_rules() -> None:
    run = promtool("check", "rules", "--lint=all", "--lint-fatal", str(ALERTS))
    assert run.returncode == 0, run.stdout + run.stderr
    count = sum(len(g["rules"]) for g in yaml.safe_load(ALERTS.read_text())["groups"])
    assert f"SUCCESS: {count} rules found" in run.stdout, run.stdout


def test_promtool_rule_tests_pass_and_cover_every_alert() -> None:
    """deploy/prometheus/alerts_test.yaml: each alert fires on its trouble, after
    its ``for:``, with its labels and summary, and not on a healthy worker."""
    tests = DEPLOY / "prometheus" / "alerts_test.yaml"
    run = promtool("test", "rules", str(tests))
    assert run.returncode == 0, run.stdout + run.stderr
    alerts = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    fired = {
        case["alertname"]
        for test in yaml.safe_load(tests.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == alerts, f"alerts without a firing case: {sorted(alerts - fired)}"


def test_promtool_accepts_the_compose_prometheus_config(tmp_path: Path) -> None:
    """The shipped config, with its rule files at the repository paths compose
    mounts into the container (promtool checks that they exist and checks them
    too); nothing else is rewritten: promtool resolves no DNS names."""
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(config_here()))
    run = promtool("check", "config", "--lint=all", "--lint-fatal", str(config))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"Checking {ALERTS}" in run.stdout, run.stdout


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


# Custom resources kubernetes-validate has no schema for (it ships the core
# API's): their own tests above check what the worker needs of them.
NO_SCHEMA = {("keda.sh/v1alpha1", "ScaledObject")}


def test_kubernetes_manifests_validate_against_the_api_schemas() -> None:
    """Strict (an unknown field is an error, as `kubectl apply` rejects it), against
    every Kubernetes version the package has schemas for, from the files it
    ships: nothing is downloaded."""
    kv = required_tools.module("kubernetes_validate")
    versions = sorted(set(kv.utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    validated = []
    for name, doc in manifests():
        kind = (doc["apiVersion"], doc["kind"])
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.SchemaNotFoundError:
                assert kind in NO_SCHEMA, f"{name}: no schema for {kind} in Kubernetes {version}"
                continue
            except kv.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                raise AssertionError(f"{name} ({version}): {path}: {exc.message}") from None
            validated.append(kind)
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in manifests()}
    assert ("apps/v1", "Deployment") in validated
    assert set(validated) == kinds - NO_SCHEMA


def test_the_secured_deployment_takes_its_secrets_from_mounted_files() -> None:
    deployment = yaml.safe_load((DEPLOY / "kubernetes" / "worker-secured.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value", "from-a-secret") for e in container["env"]}
    settings = load_settings(env=env)
    assert settings.kafka.security_protocol == "SASL_SSL"
    assert not any(e["name"].endswith("_PASSWORD") for e in container["env"])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    for path in (settings.kafka.sasl_plain_password_file, settings.kafka.ssl_cafile):
        assert path is not None and any(path.startswith(m + "/") for m in mounts), path
    volumes = {v["name"] for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} == volumes


def test_the_shadow_deployment_is_a_shadow_of_its_own() -> None:
    """deploy/kubernetes/worker-shadow.yaml: a valid configuration with
    kafka.shadow, a group and a result topic of its own, the candidate model
    from a mounted volume."""
    base = yaml.safe_load((DEPLOY / "kubernetes" / "worker.yaml").read_text())
    shadow = yaml.safe_load((DEPLOY / "kubernetes" / "worker-shadow.yaml").read_text())

    def settings(doc: dict[str, Any]) -> Any:
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        return load_settings(env={e["name"]: e.get("value", "pod-0") for e in container["env"]})

    prod, cand = settings(base), settings(shadow)
    assert cand.kafka.shadow and not prod.kafka.shadow
    assert cand.kafka.input_topics == prod.kafka.input_topics
    assert cand.kafka.group_id != prod.kafka.group_id
    assert cand.kafka.output_topic != prod.kafka.output_topic
    (container,) = shadow["spec"]["template"]["spec"]["containers"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(cand.model.path.startswith(m + "/") for m in mounts)
    assert shadow["metadata"]["name"] != base["metadata"]["name"]
