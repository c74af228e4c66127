"""Flow control's edges: Envoy's timeout fitted to the queue TTL, and who may set identity."""

from __future__ import annotations

import json

import yaml
from prometheus_client import REGISTRY

from epp.config import Config, parse_config
from epp.envoy_config import ext_proc_settings, render
from epp.extproc.stream import StreamHandler
from epp.request import ApiKey, RequestPolicy, parse_request
from epp.wire import SERVED
from tests.unit.test_response_stream import _response_body, _response_headers
from tests.unit.test_stream import body_msg, headers_msg, make_router


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


def _config(request: dict[str, object]) -> Config:
    return parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8000"]}},
            "request": request,
        }
    )


def _removed(config: Config) -> set[str]:
    boot = yaml.safe_load(render(config))
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    mutation = hcm["typed_config"]["http_filters"][0]["typed_config"]["mutations"]
    return {m["remove"] for m in mutation["request_mutations"]}


IDENTITY = {
    "x-priority",
    "x-gateway-inference-objective",
    "x-gateway-inference-fairness-id",
    "x-llm-d-slo-ttft-ms",
    "x-llm-d-slo-tpot-ms",
}


def test_envoy_strips_identity_headers_unless_a_gateway_in_front_sets_them() -> None:
    assert _removed(_config({})) >= IDENTITY
    assert _removed(_config({"api_keys": {"sk-a": {"tenant": "a"}}})) >= IDENTITY
    # Renamed headers are the ones stripped.
    renamed = _removed(_config({"priority_header": "X-Prio", "fairness_header": "x-tenant"}))
    assert {"x-prio", "x-tenant"} <= renamed
    assert not IDENTITY & _removed(_config({"trusted_headers": True}))


def test_identity_comes_only_from_trusted_sources() -> None:
    body = b'{"model":"m","prompt":"p"}'
    claims = {
        "x-priority": "10",
        "x-gateway-inference-fairness-id": "vip",
        "x-gateway-inference-objective": "critical",
    }
    objectives = {"critical": 10, "batch": -1}

    def identity(policy: RequestPolicy, headers: dict[str, str]) -> tuple[int, str, str]:
        request = parse_request("/v1/completions", headers, body, policy)
        return request.priority, request.fairness_id, request.objective

    # The default trusts nothing a client sends.
    default = RequestPolicy(objectives=objectives, api_keys={"sk-evals": ApiKey("evals", "batch")})
    assert identity(default, claims) == (0, "default-flow", "")
    keyed = {**claims, "authorization": "Bearer sk-evals"}
    assert identity(default, keyed) == (-1, "evals", "batch")
    # A gateway in front sets every header.
    gateway = RequestPolicy(objectives=objectives, trusted_headers=True)
    assert identity(gateway, claims) == (10, "vip", "critical")
    # An authenticating filter (JWT claims) sets tenant and objective only: priority follows
    # the objective, a priority header is not read.
    jwt = _config(
        {
            "objectives": objectives,
            "jwt": {"jwks_file": "/etc/jwks.json", "issuer": "https://issuer.test"},
        }
    ).request
    assert identity(jwt, claims) == (10, "vip", "critical")
    assert identity(jwt, {**claims, "x-gateway-inference-objective": "batch"}) == (
        -1,
        "vip",
        "batch",
    )
    assert identity(jwt, {"x-priority": "10"}) == (0, "default-flow", "")


async def test_objective_metric_labels_name_the_trusted_objective() -> None:
    """A client's objective header never becomes a label; its API key's objective does."""
    router = await make_router()
    router.config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "request": {
                "objectives": {"critical": 10},
                "api_keys": {"sk-c": {"tenant": "c", "objective": "critical"}},
            },
        }
    )
    body = json.dumps({"model": "tiny", "prompt": "p", "max_tokens": 4}).encode()
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 4}})

    def completion_tokens(objective: str) -> float:
        labels = {"model": "tiny", "objective": objective, "kind": "completion"}
        return REGISTRY.get_sample_value("epp_tokens_total", labels) or 0.0

    def send(headers: dict[str, str]) -> None:
        handler = StreamHandler(router)
        handler.handle(headers_msg(extra=headers))
        handler.handle(body_msg(body))
        assert handler.ticket is not None
        response = {":status": "200", "content-type": "application/json"}
        handler.handle(_response_headers({**response, SERVED: handler.ticket.endpoint}))
        handler.handle(_response_body(usage.encode(), eos=True))
        handler.settle()
        handler.close()
        router.finish(handler.ticket)

    before = {o: completion_tokens(o) for o in ("", "critical")}
    send({"x-gateway-inference-objective": "critical"})
    assert completion_tokens("critical") == before["critical"]
    assert completion_tokens("") == before[""] + 4
    send({"authorization": "Bearer sk-c"})
    assert completion_tokens("critical") == before["critical"] + 4
