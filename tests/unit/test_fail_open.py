"""``pools.<name>.epp_unreachable``: parsed per pool and rendered as the balancer Envoy uses for
a request without epp's answer (e2e through Envoy: tests/e2e/test_fail_open.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config import Config, ConfigError, parse_config
from epp.envoy_config import FAIL_OPEN_KEY, bootstrap, render
from epp.wire import LB_NAMESPACE
from tests.helpers.envoy import envoy_binary, validate


def _config(a: str | None, b: str | None = None) -> Config:
    def pool(port: int, unreachable: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"endpoints": [f"127.0.0.1:{port}"]}
        if unreachable is not None:
            out["epp_unreachable"] = unreachable
        return out

    pools = {"a": pool(8001, a)}
    if b is not None:
        pools["b"] = pool(8002, b)
    models = {"m1": {"pools": ["a"]}, **({"m2": {"pools": ["b"]}} if "b" in pools else {})}
    return parse_config({"models": models, "pools": pools})


def _pool(config: Config, **kw: Any) -> dict[str, Any]:
    clusters = bootstrap(config, **kw)["static_resources"]["clusters"]
    (pool,) = [c for c in clusters if c["name"] == "pool"]
    return pool


def _unanswered(pool: dict[str, Any]) -> dict[str, Any]:
    override = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    fallback: dict[str, Any] = override["typed_config"]["fallback_policy"]["policies"][0][
        "typed_extension_config"
    ]
    return fallback


def _marked(pool: dict[str, Any]) -> list[int]:
    return [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
        if e.get("metadata", {}).get("filter_metadata", {}).get(LB_NAMESPACE, {}).get(FAIL_OPEN_KEY)
    ]


def test_parsed_per_pool_default_fail_closed() -> None:
    assert _config(None).fail_open == frozenset()
    assert _config("fail_closed").fail_open == frozenset()
    assert _config("fail_open", "fail_closed").fail_open == frozenset({"a"})
    with pytest.raises(ConfigError, match=r"pools\.a\.epp_unreachable: must be one of"):
        _config("open")


def test_fail_closed_never_returns_a_host() -> None:
    fallback = _unanswered(_pool(_config("fail_closed")))
    assert fallback["typed_config"]["fallback_policy"] == "NO_FALLBACK"
    assert "default_subset" not in fallback["typed_config"]


def test_every_pool_fail_open_is_least_request_over_the_cluster() -> None:
    pool = _pool(_config("fail_open", "fail_open"))
    assert _unanswered(pool)["name"] == "envoy.load_balancing_policies.least_request"
    assert _marked(pool) == []  # nothing to tell apart


def test_mixed_pools_fail_open_only_onto_marked_replicas() -> None:
    pool = _pool(_config("fail_open", "fail_closed"))
    fallback = _unanswered(pool)["typed_config"]
    assert fallback["fallback_policy"] == "DEFAULT_SUBSET"
    assert fallback["default_subset"] == {FAIL_OPEN_KEY: True}
    assert _marked(pool) == [8001]
    with pytest.raises(ValueError, match="EDS file"):
        bootstrap(_config("fail_open", "fail_closed"), eds_dir="/tmp/eds")


def test_full_duplex_cannot_fail_open() -> None:
    with pytest.raises(ValueError, match="needs --mode buffered"):
        render(_config("fail_open"), mode="full-duplex")
    render(_config("fail_closed"), mode="full-duplex")


@pytest.mark.skipif(envoy_binary() is None, reason="envoy binary not installed")
@pytest.mark.parametrize("pools", [("fail_open", "fail_open"), ("fail_open", "fail_closed")])
def test_fail_open_renders_a_config_envoy_accepts(tmp_path: Path, pools: tuple[str, str]) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render(_config(*pools)))
    assert yaml.safe_load(path.read_text())
    result = validate(path)
    assert result.returncode == 0, result.stdout
