"""The shipped operations files: alert rules pass promtool's own unit tests, and every metric the rules and the
dashboard use is one a running gateway exposes (a renamed metric would silently blind an alert)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from loadtests.engine.harness import EnginePair
from tests.gateway_harness import ROOT, model_entry, running_gateway, write_config

DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "kvgate-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "kvgate-dashboard.json"
# The sample names each metric type declares (a counter's TYPE line already ends in _total).
_SUFFIXES = {"counter": ("",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    return path


def test_alert_rules_are_valid_and_pass_their_unit_tests() -> None:
    promtool = _promtool()
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", "kvgate-alerts.test.yml"], cwd=RULES.parent,
                            capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def _referenced() -> dict[str, set[str]]:
    rules = yaml.safe_load(RULES.read_text())
    rule_exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    panel_exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return {source: {name for expr in exprs for name in re.findall(r"\bkvgate_\w+", expr)}
            for source, exprs in (("rules", rule_exprs), ("dashboard", panel_exprs))}


def test_every_metric_the_rules_and_dashboard_use_is_exposed(glm_pair: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])])
    with running_gateway(config) as gateway:
        text = httpx.get(gateway.url + "/metrics", timeout=10).text
    exposed = {f"{name}{suffix}" for name, kind in re.findall(r"^# TYPE (\w+) (\w+)$", text, re.MULTILINE)
               for suffix in _SUFFIXES.get(kind, ("",))}
    for source, names in _referenced().items():
        assert names, source
        assert names <= exposed, f"{source} uses metrics the gateway does not expose: {sorted(names - exposed)}"
