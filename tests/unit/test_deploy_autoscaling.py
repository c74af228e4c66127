"""The autoscaling examples (deploy/kubernetes/autoscaling/): the HPA and prometheus-adapter's
ConfigMap validate as Kubernetes 1.33 objects; KEDA's ScaledObject (no schema offline) is
checked field by field; all of them scale the base's model servers on epp's signal for a pool
the base configures. tests/e2e/test_prometheus_queries.py runs KEDA's query against a real
Prometheus scraping a real epp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from tests.unit.test_deploy_kubernetes import K8S_VERSION, KUBE, render

AUTOSCALING = KUBE / "autoscaling"
SIGNAL = "epp_pool_desired_replicas"


def docs(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((AUTOSCALING / name).read_text()))


def base() -> tuple[set[str], set[str]]:
    """The base's Deployments and the pools its epp config names."""
    objects = render(KUBE / "base")
    deployments = {d["metadata"]["name"] for d in objects if d["kind"] == "Deployment"}
    (config_map,) = (d for d in objects if d["kind"] == "ConfigMap")
    pools = set(yaml.safe_load(config_map["data"]["epp.yaml"])["pools"])
    return deployments, pools


def test_hpa_and_adapter_rule_validate_and_agree() -> None:
    hpa, adapter = docs("hpa-external.yaml")
    for obj in (hpa, adapter):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    deployments, pools = base()
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == SIGNAL
    assert metric["external"]["metric"]["selector"]["matchLabels"]["pool"] in pools
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    assert rule["name"]["as"] == SIGNAL
    assert rule["seriesQuery"].startswith(SIGNAL)


def test_keda_scaled_object_scales_from_zero_on_the_signal() -> None:
    (scaled,) = docs("keda-scaledobject.yaml")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    deployments, pools = base()
    assert spec["scaleTargetRef"]["name"] in deployments
    assert spec["minReplicaCount"] == 0 < spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"
    query = trigger["metadata"]["query"]
    assert SIGNAL in query
    assert any(f'pool="{pool}"' in query for pool in pools)


def keda_query() -> str:
    """The ScaledObject's PromQL (the e2e test evaluates it)."""
    (scaled,) = docs("keda-scaledobject.yaml")
    return str(scaled["spec"]["triggers"][0]["metadata"]["query"])


def test_examples_are_listed() -> None:
    assert {p.name for p in Path(AUTOSCALING).glob("*.yaml")} == {
        "keda-scaledobject.yaml",
        "hpa-external.yaml",
    }
