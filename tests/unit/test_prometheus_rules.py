"""The shipped Prometheus rules and Grafana dashboard: promtool checks them and runs the alert
unit tests (deploy/prometheus/rules/epp_test.yaml); every alert has at least one such test, and
the compose stack provisions both. Whether their queries find data is tests/e2e's job
(test_prometheus_queries.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules" / "epp.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "rules" / "epp_test.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "epp.json"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:  # under CI=true this skip is a failure (tests/helpers/ci_strict.py)
        pytest.skip("promtool is needed: apt-get install prometheus (.ci/run does)")
    return subprocess.run([binary, *args], capture_output=True, text=True, check=False)


def test_rules_pass_promtool_check() -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_unit_tests_pass() -> None:
    out = promtool("test", "rules", str(RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_firing_unit_test() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert alerts >= {
        "EppDown",
        "InferencePoolNoReadyEndpoint",
        "EppHighErrorRate",
        "EppTTFTObjectiveBurn",
        "InferencePoolSaturated",
    }
    firing = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts == firing


def test_dashboard_panels_query_the_provisioned_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert rows == {"Pool", "Model", "Endpoint", "Scheduler", "Admission"}
    datasource = yaml.safe_load(
        (REPO / "deploy/compose/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == datasource, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(t["expr"] for t in panel["targets"]), panel["title"]


def test_compose_stack_provisions_dashboard_and_rules() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert (
        "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro"
        in (compose["grafana"]["volumes"])
    )
    assert "./deploy/prometheus/rules:/etc/prometheus/rules:ro" in compose["prometheus"]["volumes"]
    prometheus = yaml.safe_load((REPO / "deploy/compose/prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["/etc/prometheus/rules/epp.yaml"]
