"""deploy/ is for operators (issue 13); Docker and Kubernetes do not run here, so
the files are checked statically: they parse, every metric a rule or a panel
queries is one the worker exports, every environment variable is a setting, and
the grace period outlasts the drain."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from worker import metrics
from worker.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


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


def test_keda_lag_threshold_is_above_the_inflight_window() -> None:
    scaled = yaml.safe_load((DEPLOY / "kubernetes" / "keda-scaledobject.yaml").read_text())
    (trigger,) = scaled["spec"]["triggers"]
    inflight = load_settings(env={}).batching.max_inflight_records
    assert int(trigger["metadata"]["lagThreshold"]) > inflight
