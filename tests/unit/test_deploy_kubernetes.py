"""The Kubernetes manifests under deploy/kubernetes/: every overlay renders with ``kubectl
kustomize`` (offline), its core objects pass ``kubernetes-validate --strict`` for Kubernetes
1.33, and its InferencePool and HTTPRoute pass their CRDs' schemas and CEL rules (read from the
shared CRD directory, see tests/helpers/k8s_schema.py). The checks are shown to catch mistakes.

The CRD checks skip, with the reason, where no CRD directory is found; this project's CI provides
it as ../shared/k8s, so under ``CI=true`` they fail instead (tests/helpers/ci_strict.py).

The trust boundary too: NetworkPolicies admit only the flows docs/kubernetes.md lists, the
build holds no secret (the Secret it needs validates and is referenced consistently), binds no
wildcard address for the KV events and mounts no service-account token where none is needed.
"""

from __future__ import annotations

import base64
import copy
import re
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
from tests.unit.test_redis_auth import SHIPPED_ACL

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
        "NetworkPolicy",
    } <= kinds
    # The Secret is the user's to create (docs/kubernetes.md), never part of the build.
    assert "Secret" not in kinds


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


def test_rbac_reads_pods_pools_rewrites_and_objectives_only(
    overlay: list[dict[str, Any]],
) -> None:
    (role,) = by_kind(overlay, "Role")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    read = [("", "pods"), ("inference.networking.k8s.io", "inferencepools")]
    read += [
        (group, resource)
        for group in ("llm-d.ai", "inference.networking.x-k8s.io")
        for resource in ("inferencemodelrewrites", "inferenceobjectives")
    ]
    assert granted == {
        (group, resource, verb) for group, resource in read for verb in ("get", "list", "watch")
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
    # The Redis password file is where the Deployment mounts the Secret: here a file of ours.
    password = tmp_path / "password"
    password.write_text("pw\n")
    data = yaml.safe_load(config_map["data"]["epp.yaml"])
    data["store"]["redis_password_file"] = str(password)
    path.write_text(yaml.safe_dump(data))
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


# ------------------------------------------------------------------- the trust boundary


def deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = (d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == name)
    return found


def container_port(docs: list[dict[str, Any]], app: str, port: str) -> str:
    """``port`` (a name or a number) of ``app``'s container, as its name."""
    spec = deployment(docs, app)["spec"]["template"]["spec"]
    for c in spec["containers"]:
        for p in c["ports"]:
            if port in (p["name"], p["containerPort"]):
                return str(p["name"])
    raise AssertionError(f"{app} has no port {port}")


def admitted(docs: list[dict[str, Any]], app: str, port: str) -> list[dict[str, Any]] | None:
    """The peers the NetworkPolicies let reach ``app``'s ``port``: None when no policy selects
    ``app`` (everything gets in), ``[{}]`` when a rule admits everyone."""
    labels = deployment(docs, app)["spec"]["template"]["metadata"]["labels"]
    selecting = [
        p
        for p in by_kind(docs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    if not selecting:
        return None
    peers: list[dict[str, Any]] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = [container_port(docs, app, p["port"]) for p in rule.get("ports", [])]
            if not ports or port in ports:
                peers += rule.get("from") or [{}]
    return peers


def app_peer(app: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": {"app": app}}}


def gateway_peer(peer: dict[str, Any]) -> bool:
    """A selector of the gateway's own pods (by the Gateway's name), nothing wider."""
    labels = peer.get("podSelector", {}).get("matchLabels", {})
    return any(k.startswith("gateway.") and v == "inference-gateway" for k, v in labels.items())


def test_network_policies_admit_only_the_listed_flows(overlay: list[dict[str, Any]]) -> None:
    # epp's ext_proc port: the gateway's Envoy only.
    ext_proc = admitted(overlay, "epp", "grpc")
    assert ext_proc
    assert all(gateway_peer(p) for p in ext_proc), ext_proc
    # The replicas' serving port: the gateway (requests) and epp (scrapes /metrics).
    serving = admitted(overlay, "vllm", "http")
    assert serving is not None
    assert app_peer("epp") in serving
    assert all(p == app_peer("epp") or gateway_peer(p) for p in serving), serving
    assert any(gateway_peer(p) for p in serving)
    # Everyone's prompt token ids and the shared state: epp only.
    assert admitted(overlay, "vllm", "kv-events") == [app_peer("epp")]
    assert admitted(overlay, "redis", "redis") == [app_peer("epp")]
    # Health answers kubelet's probes from anywhere; metrics only Prometheus' namespace.
    assert admitted(overlay, "epp", "grpc-health") == [{}]
    (metrics,) = admitted(overlay, "epp", "metrics") or [{}]
    assert metrics.keys() == {"namespaceSelector"}


def test_network_policy_model_sees_an_open_door() -> None:
    """The check above fails on a policy that lets any pod reach Redis or the KV events."""
    docs = render(KUBE / "overlays" / "envoy-gateway")
    policy = next(p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "redis")
    policy["spec"]["ingress"].append({"ports": [{"port": 6379}]})
    assert admitted(docs, "redis", "redis") == [app_peer("epp"), {}]
    vllm = next(p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "vllm")
    vllm["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})
    assert admitted(docs, "vllm", "kv-events") != [app_peer("epp")]
    assert problems(policy) == []
    policy["spec"]["ingress"][0]["form"] = policy["spec"]["ingress"][0].pop("from")
    assert problems(policy) != []


SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|API_?KEY|CREDENTIAL", re.IGNORECASE)
INLINE_SECRET_KEYS = ("debug_token", "explain_token", "redis_password", "api_keys")


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in by_kind(docs, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        for c in (*spec.get("initContainers", []), *spec["containers"]):
            yield d["metadata"]["name"], c


def inline_secrets(docs: list[dict[str, Any]]) -> list[str]:
    """Every secret the build carries as text rather than as a reference."""
    found = [f"Secret/{d['metadata']['name']}" for d in by_kind(docs, "Secret")]
    for name, c in containers(docs):
        for env in c.get("env", []):
            if SECRET_NAME.search(env["name"]) and "value" in env:
                found.append(f"{name}: env {env['name']} has an inline value")
        for text in strings([c.get("command", []), c.get("args", [])]):
            if re.search(r"://[^/\s]*:[^/\s]*@|requirepass|--pass\b|>[^\s]", text):
                found.append(f"{name}: a password on the command line: {text[:40]}...")
    for config_map in by_kind(docs, "ConfigMap"):
        for text in config_map.get("data", {}).values():
            config = yaml.safe_load(text) or {}
            for section in config.values():
                for secret in INLINE_SECRET_KEYS:
                    if isinstance(section, dict) and section.get(secret):
                        found.append(f"ConfigMap/{config_map['metadata']['name']}: {secret}")
            url = config.get("store", {}).get("redis_url", "")
            if re.search(r"://[^/]*@", url) or "password=" in url:
                found.append(f"ConfigMap/{config_map['metadata']['name']}: password in redis_url")
    return found


def test_the_build_holds_no_inline_secret(overlay: list[dict[str, Any]]) -> None:
    assert inline_secrets(overlay) == []


def test_inline_secret_check_can_fail() -> None:
    docs = render(KUBE / "overlays" / "istio")
    redis = deployment(docs, "redis")["spec"]["template"]["spec"]["containers"][0]
    redis["args"] = ["--requirepass", "hunter2"]
    redis.setdefault("env", []).append({"name": "REDIS_PASSWORD", "value": "hunter2"})
    (config_map,) = by_kind(docs, "ConfigMap")
    config = yaml.safe_load(config_map["data"]["epp.yaml"])
    config["store"]["redis_url"] = "redis://epp:hunter2@redis:6379/0"
    config["server"]["debug_token"] = "hunter2"
    config_map["data"]["epp.yaml"] = yaml.safe_dump(config)
    docs.append({"kind": "Secret", "metadata": {"name": "x"}, "data": {}})
    found = "\n".join(inline_secrets(docs))
    for expected in (
        "Secret/x",
        "env REDIS_PASSWORD",
        "a password on the command line",
        "password in redis_url",
        "debug_token",
    ):
        assert expected in found, found


def test_the_redis_secret_validates_and_both_sides_use_it(
    overlay: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The Secret docs/kubernetes.md has users create is valid, and it is the one Redis and
    epp mount: Redis builds its ACL user from it, epp's configuration reads it there."""
    kubectl = shutil.which("kubectl")
    assert kubectl
    out = subprocess.run(
        [
            *(kubectl, "create", "secret", "generic", "epp-redis", "--dry-run=client"),
            *("-o", "yaml", "--from-literal=password=0123456789abcdef"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    secret = yaml.safe_load(out.stdout)
    assert problems(secret) == []
    assert base64.b64decode(secret["data"]["password"]) == b"0123456789abcdef"

    def mount_of(app: str) -> str:
        spec = deployment(overlay, app)["spec"]["template"]["spec"]
        (volume,) = (
            v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "epp-redis"
        )
        (container,) = spec["containers"]
        (mount,) = (m for m in container["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True
        return str(mount["mountPath"])

    config = yaml.safe_load(next(by_kind(overlay, "ConfigMap"))["data"]["epp.yaml"])
    store = config["store"]
    assert Path(store["redis_password_file"]) == Path(mount_of("epp")) / "password"
    redis = deployment(overlay, "redis")["spec"]["template"]["spec"]["containers"][0]
    script = " ".join(redis["args"])
    assert f"{mount_of('redis')}/password" in script
    assert "--user default off resetpass" in script
    # The ACL the real-Redis test (test_redis_auth.py) runs epp under.
    acl = SHIPPED_ACL.replace("~{epp}*", "'~{epp}*'")
    assert f"--user {store['redis_username']} on " in script
    assert script.endswith(acl)


def test_kv_events_bind_the_pod_address_and_nothing_binds_a_wildcard(
    overlay: list[dict[str, Any]],
) -> None:
    """vLLM publishes KV events on $(POD_IP), which the downward API sets to the pod's address.
    epp's own listeners (server.host in the ConfigMap) are the one wildcard: in the pod's
    network namespace that is the pod address and loopback (kubectl port-forward)."""
    wildcard = re.compile(r"tcp://\*|tcp://0\.0\.0\.0|tcp://\[::\]|--host[= ](0\.0\.0\.0|::)\b")
    for name, c in containers(overlay):
        for text in strings([c.get("command", []), c.get("args", []), c.get("env", [])]):
            assert not wildcard.search(text), f"{name}: {text}"
    (vllm,) = deployment(overlay, "vllm")["spec"]["template"]["spec"]["containers"]
    (events,) = (a for a in vllm["args"] if a.startswith("--kv-events-config="))
    assert yaml.safe_load(events.partition("=")[2])["endpoint"] == "tcp://$(POD_IP):5557"
    env = {e["name"]: e for e in vllm["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_only_epp_mounts_a_service_account_token(overlay: list[dict[str, Any]]) -> None:
    """epp reads the InferencePool and its pods through the API (--pool-name); nothing else
    here talks to it, so nothing else gets a token to steal."""
    for d in by_kind(overlay, "Deployment"):
        spec = d["spec"]["template"]["spec"]
        if d["metadata"]["name"] == "epp":
            assert spec.get("automountServiceAccountToken", True) is True
            (container,) = spec["containers"]
            assert any(a.startswith("--pool-name=") for a in container["args"])
        else:
            assert spec.get("automountServiceAccountToken") is False, d["metadata"]["name"]
