"""The deployment files cannot run here (no Docker, no Kubernetes), so they are checked for what
drifts silently: a DELAY_SIDECAR_* variable that is no setting (ignored at start), a dashboard
query on a metric that is not exported (an empty panel), a policy that does not load."""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from sidecar.metrics import Metrics
from sidecar.policy import load_policies
from sidecar.settings import ENV_PREFIX, RunSettings
from sidecar.supervisor import SupervisorMetrics
from tests.kafka_helpers import ROOT

DEPLOY = ROOT / "deploy"
COMPOSE_FILES = [ROOT / "docker-compose.yml", DEPLOY / "docker-compose.yml"]
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"), "gauge": ("",)}


def load_all(path: Path) -> list[Any]:
    return [doc for doc in YAML(typ="safe").load_all(path.read_text()) if doc is not None]


def compose_environments(path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    for name, service in load_all(path)[0]["services"].items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        yield name, {str(k): str(v) for k, v in env.items()}


def k8s_environments(path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    for doc in load_all(path):
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            # A value from elsewhere (the pod's name) still names a setting; "from-k8s" stands for it.
            env = {e["name"]: str(e.get("value", "from-k8s")) for e in container.get("env", [])}
            yield f"{doc['metadata']['name']}/{container['name']}", env


def sidecar_environments() -> list[tuple[str, dict[str, str]]]:
    found = [
        (f"{path.relative_to(ROOT)}:{name}", {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)})
        for path in COMPOSE_FILES
        for name, env in compose_environments(path)
    ] + [(f"{path.relative_to(ROOT)}:{name}", env) for path in K8S_FILES for name, env in k8s_environments(path)]
    return [(where, env) for where, env in found if env]


def exported_metric_names() -> set[str]:
    names = set()
    for registry in (Metrics().registry, SupervisorMetrics().registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def test_the_deployment_files_configure_sidecars() -> None:
    """Guards the checks below: a parser that found nothing would pass them all."""
    where = [w for w, _ in sidecar_environments()]
    assert sum("deploy/docker-compose.yml" in w for w in where) == 3, where
    assert sum("k8s" in w for w in where) == 1, where
    assert DASHBOARDS


@pytest.mark.parametrize("where,env", sidecar_environments(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_variable_the_deployment_sets_is_a_setting_with_a_valid_value(
    where: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    unknown = sorted(k for k in env if k.removeprefix(ENV_PREFIX).lower() not in RunSettings.model_fields)
    assert not unknown, f"{where}: not settings of delay-sidecar run: {unknown}"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = RunSettings()  # a value the sidecar would refuse fails here
    assert settings.bootstrap_servers, f"{where}: a cluster deployment must name its Kafka"


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda p: p.name)
def test_every_metric_a_dashboard_queries_is_exported(dashboard: Path) -> None:
    exprs = [t["expr"] for panel in json.loads(dashboard.read_text())["panels"] for t in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\bdelay_sidecar_[a-z_]+", expr)}
    assert len(used) >= 5, f"{dashboard.name}: the dashboard queries almost nothing: {sorted(used)}"
    missing = sorted(used - exported_metric_names())
    assert not missing, f"{dashboard.name}: no such metric in sidecar/metrics.py or the supervisor's: {missing}"


def test_the_prometheus_configs_and_the_grafana_provisioning_parse() -> None:
    for path in [*DEPLOY.glob("*.yml"), *(DEPLOY / "grafana" / "provisioning").rglob("*.yml")]:
        assert load_all(path), path


def test_the_kubernetes_example_policies_load(tmp_path: Path) -> None:
    maps = [d for path in K8S_FILES for d in load_all(path) if d["kind"] == "ConfigMap"]
    assert maps
    for config_map in maps:
        for name, text in config_map["data"].items():
            (tmp_path / name).write_text(text)
            assert load_policies(tmp_path / name).topics


def test_the_kubernetes_example_has_a_pod_disruption_budget_for_its_statefulset() -> None:
    docs = [d for path in K8S_FILES for d in load_all(path)]
    sets = [d for d in docs if d["kind"] == "StatefulSet"]
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert sets and budgets
    for statefulset in sets:
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert any(b["spec"]["selector"]["matchLabels"].items() <= labels.items() for b in budgets)
