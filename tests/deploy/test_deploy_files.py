"""The deployment files validate without a cluster: kustomize renders them (kubectl's built-in kustomize), every
object passes the Kubernetes 1.30 schemas (kubernetes-validate, offline, strict: unknown fields fail), the pieces
refer to each other correctly, the gateway config inside is one kvgate accepts, Prometheus' scrape config passes
promtool, the systemd unit passes systemd-analyze, the YAML passes yamllint, and the Dockerfile copies what exists."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter

from gateway.config import GatewayConfig
from tests.gateway_harness import ROOT

DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its built-in kustomize renders deploy/)")
    result = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object of that kind and name (a generated ConfigMap's name carries its content hash)."""
    def named(doc: dict[str, Any]) -> bool:
        actual = doc["metadata"]["name"]
        return actual == name or (kind == "ConfigMap" and actual.startswith(name + "-"))

    found = [d for d in docs if d["kind"] == kind and named(d)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in docs])
    return found[0]


def test_every_object_passes_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == ["ConfigMap", "ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "Service", "Service", "Service"]
    for doc in rendered:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    broken = copy.deepcopy(_one(rendered, "Deployment", "kvgate"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # the validator is real
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30", strict=True)


def test_the_gateway_deployment_is_what_operators_need(rendered: list[dict[str, Any]]) -> None:
    deployment = _one(rendered, "Deployment", "kvgate")
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert spec["replicas"] >= 2 and spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    labels = spec["template"]["metadata"]["labels"]
    for kind, name in (("Service", "kvgate"), ("Service", "kvgate-metrics"), ("PodDisruptionBudget", "kvgate")):
        selector = _one(rendered, kind, name)["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), (kind, name)
    hpa = _one(rendered, "HorizontalPodAutoscaler", "kvgate")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvgate"}
    assert hpa["minReplicas"] >= 2
    # The config the pods mount is the generated ConfigMap (kustomize renamed it with its content hash).
    config_map = _one(rendered, "ConfigMap", "kvgate-config")
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    config = GatewayConfig.model_validate(yaml.safe_load(config_map["data"]["kvgate.yaml"]))
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert container["args"][container["args"].index("--config") + 1] == f"{mount}/kvgate.yaml"
    assert pod["terminationGracePeriodSeconds"] > config.shutdown.grace_s  # the drain fits before SIGKILL
    assert config.state.backend == "redis" and config.listen.port == container["ports"][0]["containerPort"]
    redis = _one(rendered, "Service", "kvgate-redis")
    assert config.state.redis_url == f"redis://kvgate-redis:{redis['spec']['ports'][0]['port']}/0"
    for model in config.models:  # the image's paths (deploy/docker/Dockerfile copies config/ to /app/config)
        assert (ROOT / Path(model.tokenizer).relative_to("/app")).is_file()


def test_the_prometheus_scrape_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    result = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=DEPLOY / "prometheus",
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_systemd_unit_passes_systemd_analyze(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = (DEPLOY / "systemd" / "kvgate.service").read_text()
    assert "ExecStart=/opt/kvgate/.venv/bin/kvgate serve --config /etc/kvgate/kvgate.yaml" in unit
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit and "RestartPreventExitStatus=3" in unit
    # Verified as installed: the binary it names must exist, so it points at this checkout's for the check.
    local = unit.replace("/opt/kvgate/.venv/bin/kvgate", str(ROOT / ".venv/bin/kvgate"))
    local = local.replace("User=kvgate", "User=root").replace("Group=kvgate", "Group=root")
    (tmp_path / "kvgate.service").write_text(local)
    result = subprocess.run([analyze, "verify", str(tmp_path / "kvgate.service")], capture_output=True, text=True)
    assert result.returncode == 0 and "kvgate.service" not in result.stderr, result.stderr


def test_the_yaml_passes_yamllint() -> None:
    rules = yamllint_config.YamlLintConfig("extends: relaxed\nrules: {line-length: {max: 120}}")
    files = [p for p in DEPLOY.rglob("*.y*ml") if p.suffix in (".yml", ".yaml")]
    assert len(files) >= 9
    problems = [f"{path.relative_to(ROOT)}:{p.line}: {p.message}" for path in files
                for p in linter.run(path.read_text(), rules) if p.level == "error"]
    assert not problems


def test_the_dockerfile_copies_what_exists_and_runs_kvgate() -> None:
    lines = [line.strip() for line in (DEPLOY / "docker" / "Dockerfile").read_text().splitlines()]
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY") and "--from" not in line]
    assert copies and all((ROOT / source).exists() for sources in copies for source in sources)
    assert 'ENTRYPOINT ["kvgate"]' in lines
    assert 'CMD ["serve", "--config", "/etc/kvgate/kvgate.yaml"]' in lines
    assert any(line.startswith("USER 10001") for line in lines)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
