"""The Kubernetes manifests under deploy/kubernetes/: every overlay renders with ``kubectl
kustomize`` (offline), its core objects pass ``kubernetes-validate --strict`` for Kubernetes
1.33, and its InferencePool and HTTPRoute pass their CRDs' schemas and CEL rules (read from the
shared CRD directory, see tests/helpers/k8s_schema.py). The checks are shown to catch mistakes.

The CRD checks skip, with the reason, where no CRD directory is found; this project's CI provides
it as ../shared/k8s, so under ``CI=true`` they fail instead (tests/helpers/ci_strict.py).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from epp.cli import build_parser
from epp.config import load_config
from epp.discovery.spec import KubernetesSpec
from tests.helpers import k8s_schema

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBE / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.33"
# Kinds neither kubernetes-validate nor our CRD directory has a schema for; checked by hand below.
GATEWAY = ("gateway.networking.k8s.io", "Gateway")


def render(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # under CI=true this skip is a failure (tests/helpers/ci_strict.py)
        pytest.skip("kubectl is needed to render the kustomizations: install it (apt kubectl)")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def group_kind(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["apiVersion"].rpartition("/")[0], obj["kind"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    return (d for d in docs if d["kind"] == kind)


def problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject ``obj`` (empty if it would not)."""
    if group_kind(obj) in k8s_schema.CRD_FILES:
        return k8s_schema.validate(obj)
    if group_kind(obj) == GATEWAY:
        spec = obj["spec"]
        return [] if spec.get("gatewayClassName") and spec.get("listeners") else ["bad Gateway"]
    try:  # an unknown kind raises SchemaNotFoundError: nothing slips through unvalidated
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [str(exc)]
    return []


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(KUBE / "overlays" / request.param)


def test_overlays_exist() -> None:
    assert {"envoy-gateway", "istio"} <= set(OVERLAYS)


def test_every_object_validates(overlay: list[dict[str, Any]]) -> None:
    for obj in overlay:
        assert problems(obj) == [], f"{obj['kind']}/{obj['metadata']['name']}"


def test_overlay_holds_the_pieces(overlay: list[dict[str, Any]]) -> None:
    kinds = {d["kind"] for d in overlay}
    assert {
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "PodDisruptionBudget",
        "InferencePool",
        "HTTPRoute",
        "Gateway",
    } <= kinds


def test_pool_route_and_epp_reference_each_other(overlay: list[dict[str, Any]]) -> None:
    (pool,) = by_kind(overlay, "InferencePool")
    (route,) = by_kind(overlay, "HTTPRoute")
    (gateway,) = by_kind(overlay, "Gateway")
    services = {s["metadata"]["name"]: s for s in by_kind(overlay, "Service")}
    deployments = {d["metadata"]["name"]: d for d in by_kind(overlay, "Deployment")}

    ref = pool["spec"]["endpointPickerRef"]
    epp_service = services[ref["name"]]
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert {"group": "inference.networking.k8s.io", "kind": "InferencePool"}.items() <= (
        backends[0].items()
    )
    assert backends[0]["name"] == pool["metadata"]["name"]
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]

    # The pool selects the model servers' pods, on the port they serve.
    vllm = deployments["vllm"]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= vllm["metadata"]["labels"].items()
    ports = {p["containerPort"] for c in vllm["spec"]["containers"] for p in c["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= ports

    # epp's Deployment: the pool it serves, the Service's selector, the shared config.
    epp = deployments["epp"]
    template = epp["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in container["args"]
    assert epp_service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (config_map,) = by_kind(overlay, "ConfigMap")
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    config = yaml.safe_load(config_map["data"]["epp.yaml"])
    discovery = config["pools"]["main"]["discovery"]["kubernetes"]
    assert discovery["pool_name"] == pool["metadata"]["name"]


def test_epp_deployment_is_highly_available(overlay: list[dict[str, Any]]) -> None:
    (epp,) = (d for d in by_kind(overlay, "Deployment") if d["metadata"]["name"] == "epp")
    assert epp["spec"]["replicas"] >= 2
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    (pdb,) = by_kind(overlay, "PodDisruptionBudget")
    labels = epp["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    config = yaml.safe_load(next(by_kind(overlay, "ConfigMap"))["data"]["epp.yaml"])
    assert config["store"]["backend"] == "redis"


def test_rbac_reads_pods_and_pools_only(overlay: list[dict[str, Any]]) -> None:
    (role,) = by_kind(overlay, "Role")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"))
        for verb in ("get", "list", "watch")
    }
    assert not list(by_kind(overlay, "ClusterRole"))
    (binding,) = by_kind(overlay, "RoleBinding")
    (account,) = by_kind(overlay, "ServiceAccount")
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    (epp,) = (d for d in by_kind(overlay, "Deployment") if d["metadata"]["name"] == "epp")
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_vllm_runs_with_the_flags_epp_relies_on(overlay: list[dict[str, Any]]) -> None:
    (vllm,) = (d for d in by_kind(overlay, "Deployment") if d["metadata"]["name"] == "vllm")
    (container,) = vllm["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--enable-prefix-caching" in args
    (events,) = (a for a in args if a.startswith("--kv-events-config="))
    assert yaml.safe_load(events.partition("=")[2])["enable_kv_cache_events"] is True


# ----------------------------------------------------------------- the validators can fail


def _pool() -> dict[str, Any]:
    pool: dict[str, Any] = yaml.safe_load((KUBE / "base" / "inferencepool.yaml").read_text())
    return pool


def _route() -> dict[str, Any]:
    path = KUBE / "overlays" / "envoy-gateway" / "httproute.yaml"
    route: dict[str, Any] = yaml.safe_load(path.read_text())
    return route


@pytest.mark.parametrize(
    ("make", "edit", "expected"),
    [
        (_pool, lambda o: o["spec"].update(targetPort=[{"number": 1}]), "targetPort"),
        (_pool, lambda o: o["spec"].update(targetPorts=[{"number": 1}] * 2), "must be unique"),
        (_pool, lambda o: o["spec"]["endpointPickerRef"].pop("port"), "port is required"),
        (_pool, lambda o: o["spec"]["selector"].update(matchLabels={}), "non-empty"),
        (
            _route,
            lambda o: o["spec"]["rules"][0].update(
                timeouts={"request": "10s", "backendRequest": "20s"}
            ),
            "cannot be longer",
        ),
        (
            _route,
            lambda o: o["spec"]["rules"][0]["matches"][0]["path"].update(value="/a//b"),
            "must not contain '//'",
        ),
    ],
    ids=[
        "misspelt-field",
        "duplicate-port",
        "service-without-port",
        "no-labels",
        "timeouts",
        "path",
    ],
)
def test_crd_validation_catches(make: Any, edit: Any, expected: str) -> None:
    obj = make()
    assert k8s_schema.validate(obj) == []
    edit(obj)
    found = k8s_schema.validate(obj)
    assert any(expected in p for p in found), found


def test_cel_rules_see_schema_defaults() -> None:
    """A match without a path type is valid (the API server defaults it to PathPrefix before
    the CEL rules read it); skipping the defaulting step would reject it."""
    route = _route()
    route["spec"]["rules"][0]["matches"] = [{"path": {"value": "/v1"}}]
    assert k8s_schema.validate(route) == []
    assert k8s_schema.validate(route, defaults=False) != []


def test_core_validation_catches_a_misspelt_field() -> None:
    (epp,) = (
        d
        for d in render(KUBE / "base")
        if d["metadata"]["name"] == "epp" and d["kind"] == "Deployment"
    )
    broken = copy.deepcopy(epp)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    assert problems(epp) == []
    assert problems(broken) != []


def test_epp_accepts_its_config_and_arguments(
    overlay: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The ConfigMap is a valid epp configuration and the container's args parse with the real
    ``epp`` command line (Kubernetes substitutes ``$(POD_NAMESPACE)`` first)."""
    (config_map,) = by_kind(overlay, "ConfigMap")
    path = tmp_path / "epp.yaml"
    path.write_text(config_map["data"]["epp.yaml"])
    config = load_config(str(path))
    (spec,) = config.discovery.values()
    assert isinstance(spec, KubernetesSpec)
    (epp,) = (d for d in by_kind(overlay, "Deployment") if d["metadata"]["name"] == "epp")
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    parsed = build_parser().parse_args(args)
    assert parsed.config == "/etc/epp/epp.yaml"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert Path(parsed.config).parent == Path(mounts["config"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (parsed.port, parsed.health_port, parsed.metrics_port) == (
        ports["grpc"],
        ports["grpc-health"],
        ports["metrics"],
    )
    assert parsed.pool_name == spec.pool_name
