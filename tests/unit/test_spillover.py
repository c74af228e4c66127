"""Spillover: its configuration, when a request spills, and the Envoy configuration it needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.admission.saturation import SaturationDetector
from epp.admission.spillover import OverflowPool, Spillover, inflight_key
from epp.config import ConfigError, parse_config
from epp.envoy_config import render
from epp.extproc import responses
from epp.request import parse_request
from epp.state.inflight import Load
from epp.state.snapshot import EndpointMetrics, EndpointState
from epp.wire import DESTINATION, LB_NAMESPACE, OVERFLOW
from tests.helpers.envoy import validate

HOME = "127.0.0.1:8001"
REMOTE = "127.0.0.1:9101"


def _data(**extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "models": {"tiny": {"pools": ["main"]}},
        "pools": {"main": {"endpoints": [HOME], "overflow": ["eu", "us"]}},
        "overflow": {
            "eu": {"gateway": ["gw.eu.example:8080"], "endpoints": [REMOTE], "max_requests": 4},
            "us": {"gateway": ["10.0.0.9:8080"], "endpoints": ["10.0.0.10:8000"]},
        },
        "request": {"objectives": {"critical": 10, "batch": {"priority": -1, "spill": True}}},
    }
    return data | extra


def test_configuration_names_overflow_pools_and_spill_eligible_objectives() -> None:
    config = parse_config(_data())
    assert config.spillover.routes == {"main": ("eu", "us")}
    assert config.spillover.pools["eu"] == OverflowPool(("gw.eu.example:8080",), (REMOTE,), 4)
    assert config.spillover.endpoints() == {REMOTE: "eu", "10.0.0.10:8000": "us"}
    assert config.request.objectives == {"critical": 10, "batch": -1}
    assert config.request.spill_objectives == {"batch"}
    # No overflow section: nothing spills, nothing extra is scraped.
    plain = parse_config(_data(overflow={}, pools={"main": {"endpoints": [HOME]}}))
    assert plain.spillover == Spillover()


def test_bad_overflow_configuration_is_reported_with_key_paths() -> None:
    data = _data(
        pools={"main": {"endpoints": [HOME], "overflow": ["eu", "nowhere"]}},
        overflow={
            "eu": {"gateway": [], "endpoints": [HOME, "no-port"], "extra": 1},
            "main": {"gateway": ["10.0.0.1:80"], "endpoints": ["10.0.0.2:80"]},
        },
        request={"objectives": {"batch": {"spill": True}, "odd": {"priority": 1, "x": 2}}},
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    text = str(caught.value)
    for expected in (
        "pools.main.overflow[1]: must name an entry of the overflow section, got 'nowhere'",
        "overflow.eu.gateway: must list at least one host:port",
        f"overflow.eu.endpoints[0]: must not be an endpoint of a home pool, got {HOME}",
        "overflow.eu.endpoints[1]: must be 'host:port'",
        "overflow.eu.extra: must be one of the known keys",
        "overflow.main: must not share a name with pool 'main'",
        "request.objectives.batch.priority: must be set",
        "request.objectives.odd.x: must be one of the known keys: priority, spill",
    ):
        assert expected in text, text
    assert len(caught.value.errors) == 8, text


def _state(address: str, waiting: int = 0, age: float = 0.0) -> EndpointState:
    return EndpointState(address, "eu", True, EndpointMetrics(waiting=waiting), 100.0 - age)


def test_overflow_is_saturated_when_its_replicas_are_full_unseen_or_at_max_requests() -> None:
    spill = parse_config(_data()).spillover
    detector = SaturationDetector()
    loads: dict[str, Load] = {}

    def saturated(endpoints: dict[str, EndpointState]) -> bool:
        return spill.saturated("eu", endpoints, detector, lambda a: loads.get(a, Load()), 100.0)

    assert not saturated({REMOTE: _state(REMOTE)})
    assert saturated({REMOTE: _state(REMOTE, waiting=5)})  # over the queue threshold
    assert saturated({REMOTE: _state(REMOTE, age=1.0)})  # stale metrics count as full
    assert saturated({})  # never scraped: never used
    loads[inflight_key("eu")] = Load(requests=4)  # max_requests of our spills in flight
    assert saturated({REMOTE: _state(REMOTE)})


def test_target_is_the_first_overflow_with_room_and_only_when_home_is_saturated() -> None:
    spill = parse_config(_data()).spillover
    checked: list[str] = []

    def target(home_full: bool, full: set[str]) -> str | None:
        return spill.target(
            spill.overflow_for(["main"]),
            lambda: home_full,
            lambda name: checked.append(name) or name in full,
        )

    assert target(False, set()) is None
    assert checked == []  # the overflow is not even looked at while home has room
    assert target(True, set()) == "eu"
    assert target(True, {"eu"}) == "us"
    assert target(True, {"eu", "us"}) is None
    assert spill.target((), lambda: True, lambda name: False) is None


def test_only_trusted_spill_eligible_objectives_carry_an_objective() -> None:
    policy = parse_config(_data()).request
    body = b'{"model":"tiny","prompt":"p"}'

    def objective(headers: dict[str, str], trusted: bool = True) -> str:
        p = type(policy)(**{**_fields(policy), "trusted_headers": trusted})
        return parse_request("/v1/completions", headers, body, p).objective

    assert objective({"x-gateway-inference-objective": "batch"}) == "batch"
    assert objective({"x-gateway-inference-objective": "unknown"}) == ""
    assert objective({"x-priority": "-1"}) == ""  # a bare priority is no objective
    assert objective({"x-gateway-inference-objective": "batch"}, trusted=False) == ""


def _fields(policy: Any) -> dict[str, Any]:
    return {f: getattr(policy, f) for f in policy.__dataclass_fields__}


def test_envoy_routes_the_overflow_header_to_the_overflow_gateway(tmp_path: Path) -> None:
    config = parse_config(_data())
    text = render(config)
    boot = yaml.safe_load(text)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    eu, us = clusters["overflow-eu"], clusters["overflow-us"]
    assert eu["type"] == "STRICT_DNS"
    assert us["type"] == "STATIC"
    (host,) = eu["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert host["endpoint"]["address"]["socket_address"] == {
        "address": "gw.eu.example",
        "port_value": 8080,
    }
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes] == ["overflow-eu", "overflow-us", "pool"]
    assert routes[0]["match"]["headers"] == [
        {"name": "x-epp-overflow", "string_match": {"exact": "eu"}}
    ]
    assert routes[0]["request_headers_to_remove"] == ["x-epp-overflow"]
    assert "5xx" not in routes[0]["route"]["retry_policy"]["retry_on"]
    # Only epp may set the header: client copies are stripped before ext_proc.
    mutation = hcm["typed_config"]["http_filters"][0]["typed_config"]["mutations"]
    assert {"remove": "x-epp-overflow"} in mutation["request_mutations"]
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    result = validate(path)
    assert result.returncode == 0, result.stdout


def test_a_spill_answer_names_the_overflow_and_no_endpoint() -> None:
    for answer in (
        responses.route_in_body("", [], overflow="eu").request_body.response,
        responses.route_in_headers("", [], 10, overflow="eu").request_headers.response,
    ):
        sets = {h.header.key: h.header.raw_value for h in answer.header_mutation.set_headers}
        assert sets.get(OVERFLOW) == b"eu"
        assert DESTINATION not in sets
        assert answer.clear_route_cache  # the route is chosen again, by the overflow header
    message = responses.route_in_body("", [], overflow="eu")
    assert DESTINATION not in message.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
