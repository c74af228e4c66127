"""Flow control's edges: Envoy's timeout fitted to the queue TTL, and who may set identity."""

from __future__ import annotations

import yaml

from epp.config import parse_config
from epp.envoy_config import ext_proc_settings, render
from epp.request import ApiKey, RequestPolicy, parse_request


def test_envoy_message_timeout_outlasts_the_queue_ttl() -> None:
    def timeout(admission: dict[str, object]) -> str:
        config = parse_config(
            {
                "models": {"tiny": {"pools": ["main"]}},
                "pools": {"main": {"endpoints": ["127.0.0.1:8000"]}},
                "admission": admission,
            }
        )
        boot = yaml.safe_load(render(config, message_timeout_ms=2000))
        (ext_proc,) = ext_proc_settings(boot)
        return str(ext_proc["message_timeout"])

    assert timeout({}) == "2s"
    # The longest band TTL (40 s) plus the 2 s margin: epp's 503 comes before Envoy's timeout.
    assert timeout({"mode": "queue", "ttl": 30, "bands": {-1: {"ttl": 40}}}) == "42s"


def test_envoy_strips_identity_headers_unless_trusted() -> None:
    def removed(request: dict[str, object]) -> set[str]:
        config = parse_config(
            {
                "models": {"tiny": {"pools": ["main"]}},
                "pools": {"main": {"endpoints": ["127.0.0.1:8000"]}},
                "request": request,
            }
        )
        boot = yaml.safe_load(render(config))
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        mutation = hcm["typed_config"]["http_filters"][0]["typed_config"]["mutations"]
        return {m["remove"] for m in mutation["request_mutations"]}

    identity = {"x-priority", "x-gateway-inference-objective", "x-gateway-inference-fairness-id"}
    assert not identity & removed({})
    assert identity <= removed({"trusted_headers": False})


def test_identity_comes_only_from_trusted_sources() -> None:
    body = b'{"model":"m","prompt":"p"}'
    claims = {"x-priority": "10", "x-gateway-inference-fairness-id": "vip"}
    objectives = {"critical": 10, "batch": -1}

    def identity(policy: RequestPolicy, headers: dict[str, str]) -> tuple[int, str]:
        request = parse_request("/v1/completions", headers, body, policy)
        return request.priority, request.fairness_id

    trusted = RequestPolicy(objectives=objectives)
    assert identity(trusted, claims) == (10, "vip")
    untrusted = RequestPolicy(
        objectives=objectives,
        trusted_headers=False,
        api_keys={"sk-evals": ApiKey("evals", "batch")},
    )
    assert identity(untrusted, claims) == (0, "default-flow")
    keyed = {**claims, "authorization": "Bearer sk-evals"}
    assert identity(untrusted, keyed) == (-1, "evals")
