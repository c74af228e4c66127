"""The Kubernetes prefill/decode example (deploy/kubernetes/examples/pd): it renders, every
object validates as in test_deploy_kubernetes, the pool selects both roles by llm-d's label,
the decode pods' sidecar fronts their engine on the pool's port and may call only the prefill
pods, which only decode pods (besides epp and the gateway) may reach, and epp's configuration
and the sidecar's arguments are what epp itself accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.cli import build_parser
from epp.config import load_config
from epp.roles import ROLE_LABEL
from tests.unit.test_deploy_kubernetes import KUBE, admitted, by_kind, deployment, problems, render


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(KUBE / "examples" / "pd")


def labels(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    found: dict[str, str] = deployment(docs, name)["spec"]["template"]["metadata"]["labels"]
    return found


def test_every_object_validates(docs: list[dict[str, Any]]) -> None:
    for obj in docs:
        assert problems(obj) == [], f"{obj['kind']}/{obj['metadata']['name']}"


def test_the_pool_selects_both_roles_and_no_aggregated_fleet(docs: list[dict[str, Any]]) -> None:
    (pool,) = by_kind(docs, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"].items()
    assert labels(docs, "vllm-prefill")[ROLE_LABEL] == "prefill"
    assert labels(docs, "vllm-decode")[ROLE_LABEL] == "decode"
    for name in ("vllm-prefill", "vllm-decode"):
        assert selector <= labels(docs, name).items()
    assert "vllm" not in {d["metadata"]["name"] for d in by_kind(docs, "Deployment")}


def test_the_decode_sidecar_fronts_its_engine_and_calls_only_prefill_pods(
    docs: list[dict[str, Any]],
) -> None:
    (pool,) = by_kind(docs, "InferencePool")
    (target,) = (p["number"] for p in pool["spec"]["targetPorts"])
    pod = deployment(docs, "vllm-decode")["spec"]["template"]["spec"]
    sidecar, engine = pod["containers"]
    assert sidecar["image"] != "epp"  # set by the kustomization's images
    args = build_parser().parse_args(sidecar["args"])
    assert args.func.__module__ == "epp.pd.sidecar"
    assert args.listen.endswith(f":{target}")
    engine_port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "engine")
    assert args.engine == f"http://127.0.0.1:{engine_port}"
    assert f"--port={engine_port}" in engine["args"]
    assert args.prefill == []
    (name,) = args.prefill_dns
    service_name = name.split(".")[0]
    (service,) = (s for s in by_kind(docs, "Service") if s["metadata"]["name"] == service_name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"app": "vllm", ROLE_LABEL: "prefill"}


def test_only_decode_pods_epp_and_the_gateway_reach_prefill_pods(
    docs: list[dict[str, Any]],
) -> None:
    peers = admitted(docs, "vllm-prefill", "nixl") or []
    assert peers == [{"podSelector": {"matchLabels": {"app": "vllm", ROLE_LABEL: "decode"}}}]
    serving = admitted(docs, "vllm-prefill", "http") or []
    assert peers[0] in serving
    assert {"podSelector": {"matchLabels": {"app": "epp"}}} in serving


def test_epp_accepts_the_configuration(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    (config_map,) = by_kind(docs, "ConfigMap")
    data = yaml.safe_load(config_map["data"]["epp.yaml"])
    password = tmp_path / "password"
    password.write_text("pw\n")
    data["store"]["redis_password_file"] = str(password)
    path = tmp_path / "epp.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_config(path)
    assert config.scheduling.profile == "pd"
    types = [p.type_name for p in config.scheduling.selected.plugins]
    assert "decode-filter" in types
    assert "prefix-based-pd-decider" in types
