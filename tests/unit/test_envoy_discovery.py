"""The pool cluster epp renders for discovered pools, checked by the real Envoy binary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config import parse_config
from epp.envoy_config import bootstrap, render
from tests.helpers.envoy import envoy_binary, validate

needs_envoy = pytest.mark.skipif(envoy_binary() is None, reason="envoy binary not installed")


def _config(**pools: dict[str, Any]) -> Any:
    return parse_config({"models": {"m": {"pools": list(pools)}}, "pools": pools})


def _pool_cluster(config: Any) -> dict[str, Any]:
    clusters = bootstrap(config)["static_resources"]["clusters"]
    return next(c for c in clusters if c["name"] == "pool")


def test_dns_pool_is_resolved_by_envoy_with_the_same_interval_and_resolver() -> None:
    config = _config(
        main={
            "discovery": {
                "dns": {"name": "sim", "port": 8000, "interval": 0.5, "resolver": "127.0.0.1:5353"}
            }
        },
        fixed={"endpoints": ["10.0.0.9:8000"]},
    )
    cluster = _pool_cluster(config)
    assert cluster["type"] == "STRICT_DNS"
    assert cluster["dns_refresh_rate"] == "0.5s"
    assert cluster["respect_dns_ttl"] is False
    hosts = [
        e["endpoint"]["address"]["socket_address"]
        for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert {"address": "sim", "port_value": 8000} in hosts
    assert {"address": "10.0.0.9", "port_value": 8000} in hosts
    resolvers = cluster["typed_dns_resolver_config"]["typed_config"]["resolvers"]
    assert resolvers == [{"socket_address": {"address": "127.0.0.1", "port_value": 5353}}]
    # Fallbacks keep working: the same override_host policy as for static pools.
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"


def test_static_only_stays_static() -> None:
    cluster = _pool_cluster(_config(main={"endpoints": ["127.0.0.1:8000"]}))
    assert cluster["type"] == "STATIC"
    assert "dns_refresh_rate" not in cluster


def test_dns_pools_with_different_resolvers_are_refused() -> None:
    config = _config(
        a={"discovery": {"dns": {"name": "a", "port": 1, "resolver": "127.0.0.1:53"}}},
        b={"discovery": {"dns": {"name": "b", "port": 1}}},
    )
    with pytest.raises(ValueError, match="different resolvers"):
        bootstrap(config)


@needs_envoy
@pytest.mark.parametrize("resolver", [None, "127.0.0.1:5353"])
def test_rendered_dns_config_validates(tmp_path: Path, resolver: str | None) -> None:
    dns: dict[str, Any] = {"name": "sim", "port": 8000}
    if resolver:
        dns["resolver"] = resolver
    path = tmp_path / "envoy.yaml"
    config = _config(main={"discovery": {"dns": dns}}, fixed={"endpoints": ["10.0.0.9:8000"]})
    path.write_text(render(config))
    result = validate(path)
    assert result.returncode == 0, result.stdout


KUBE = {"discovery": {"kubernetes": {"pool_name": "vllm-pool"}}}


def test_kubernetes_pool_needs_the_eds_file() -> None:
    with pytest.raises(ValueError, match="--eds-dir"):
        bootstrap(_config(gpu=KUBE))


def test_eds_cluster_reads_the_file_epp_writes(tmp_path: Path) -> None:
    data = bootstrap(_config(gpu=KUBE, main={"endpoints": ["10.0.0.1:8000"]}), eds_dir="/run/eds")
    cluster = next(c for c in data["static_resources"]["clusters"] if c["name"] == "pool")
    assert cluster["type"] == "EDS"
    assert "load_assignment" not in cluster
    source = cluster["eds_cluster_config"]["eds_config"]["path_config_source"]
    assert source == {"path": "/run/eds/pool.yaml", "watched_directory": {"path": "/run/eds"}}
    assert data["node"]["id"]  # Envoy refuses xDS subscriptions without a node identity


@needs_envoy
def test_envoy_config_cli_seeds_the_eds_file_and_the_config_validates(tmp_path: Path) -> None:
    from epp.cli import main

    config = tmp_path / "epp.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": {"m": {"pools": ["gpu", "main"]}},
                "pools": {"gpu": KUBE, "main": {"endpoints": ["10.0.0.1:8000"]}},
            }
        )
    )
    eds_dir, out = tmp_path / "eds", tmp_path / "envoy.yaml"
    assert main(["envoy-config", "-c", str(config), "--eds-dir", str(eds_dir), "-o", str(out)]) == 0
    seeded = json.loads((eds_dir / "pool.yaml").read_text())
    hosts = seeded["resources"][0]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["address"]["socket_address"]["address"] for h in hosts] == ["10.0.0.1"]
    result = validate(out)
    assert result.returncode == 0, result.stdout
