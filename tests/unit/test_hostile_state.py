"""What a hostile client can grow: session ids, fairness ids, priorities, objectives, metric
series, buffered bodies. Each bound is asserted as a count (entries, series, bytes), not a time.
The same attack at scale, through a real Envoy, is benchmarks/hostile_state.py."""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY

from epp.admission.flows import MAX_FLOW_ID_BYTES, OTHER_FLOW, FlowBound
from epp.config import parse_config
from epp.errors import RequestError
from epp.extproc import buffered
from epp.extproc.stream import StreamHandler
from epp.lifecycle import RequestContext
from epp.request import (
    MAX_SESSION_BYTES,
    SESSION_DIGEST_BYTES,
    RequestPolicy,
    parse_request,
    session_key,
)
from epp.state.shared.sessions import Binding, SharedSessionTable
from tests.unit.test_stream import BODY, body_msg, headers_msg, make_router

BASE = {
    "models": {"tiny": {"pools": ["main"]}},
    "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
}


def series(name: str) -> list[dict[str, str]]:
    """The label sets of ``name``'s live samples in the default registry."""
    return [
        dict(s.labels)
        for metric in REGISTRY.collect()
        if metric.name == name
        for s in metric.samples
    ]


# ---------------------------------------------------------------------------- sessions


def test_a_session_is_kept_as_a_fixed_size_digest_and_a_long_header_is_refused() -> None:
    policy = RequestPolicy()
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    keys = {
        parse_request("/v1/completions", {"x-session-token": raw}, body, policy).session
        for raw in ("a", "b" * MAX_SESSION_BYTES, "é" * (MAX_SESSION_BYTES // 2))
    }
    assert len(keys) == 3
    assert all(k is not None and len(k) == 2 * SESSION_DIGEST_BYTES for k in keys)
    with pytest.raises(RequestError) as refused:
        parse_request(
            "/v1/completions", {"x-session-token": "x" * (MAX_SESSION_BYTES + 1)}, body, policy
        )
    assert refused.value.status == 400
    assert refused.value.param == "x-session-token"
    assert json.loads(refused.value.body())["error"]["type"] == "invalid_request_error"


def test_remote_bindings_that_are_no_digest_are_not_kept() -> None:
    """An older epp (or a stranger) shipping a raw 48 KiB session id grows nothing here."""
    table = SharedSessionTable(max_sessions=10)
    far = 4_000_000_000.0
    table.apply(
        [
            Binding("x" * 49_152, "10.0.0.1:8000", far),
            Binding("g" * 32, "10.0.0.1:8000", far),  # the right length, not hex
            Binding(session_key(b"ok"), "10.0.0.1:8000", far),
        ]
    )
    assert len(table) == 1
    assert table.get(session_key(b"ok"), far - 1) == "10.0.0.1:8000"


def test_ten_thousand_sessions_keep_the_table_at_its_bound() -> None:
    table = SharedSessionTable(max_sessions=1000)
    for i in range(10_000):
        table.bind(session_key(str(i).encode() * 4096), "10.0.0.1:8000", 0.0, 60.0)
    assert len(table) == 1000
    assert all(len(b.session) == 32 for b in table.take_recent())


# ---------------------------------------------------------------------------- flows


def test_distinct_flows_per_window_are_capped_and_the_rest_share_one() -> None:
    bound = FlowBound(max_flows=100, window=60.0)
    bound.configure(["paying"], [])
    kept = {bound.flow(f"tenant-{i}", 1.0) for i in range(10_000)}
    assert len(kept) == 101  # 100 ids, then everyone else as one flow
    assert OTHER_FLOW in kept
    # Configured tenants and the default flow always pass, and so do ids already kept.
    assert bound.flow("paying", 2.0) == "paying"
    assert bound.flow("default-flow", 2.0) == "default-flow"
    assert bound.flow("tenant-5", 2.0) == "tenant-5"
    assert bound.flow("y" * (MAX_FLOW_ID_BYTES + 1), 2.0) == OTHER_FLOW
    # Next window: last window's ids keep their place, newcomers get the cap again; the kept
    # set never exceeds twice the cap.
    for i in range(10_000):
        bound.flow(f"tenant-{i}", 70.0)
        bound.flow(f"new-{i}", 70.0)
    assert bound.flow("tenant-99", 71.0) == "tenant-99"
    assert len(bound._flows.current) <= 200


def test_priorities_beyond_the_cap_run_no_higher_than_asked() -> None:
    bound = FlowBound(max_priorities=4)
    bound.configure([], [10, -5])
    assert [bound.priority(p, 0.0) for p in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert bound.priority(10, 0.0) == 10  # configured: always
    assert bound.priority(999_999, 0.0) == 10
    assert bound.priority(7, 0.0) == 0
    assert bound.priority(-3, 0.0) == -5
    assert bound.priority(-99, 0.0) == -5  # below every configured one: the lowest
    assert bound.priority_label(999_999) == "other"
    assert bound.priority_label(-5) == "-5"


async def test_ten_thousand_flows_and_priorities_leave_bounded_state_and_series() -> None:
    """Through admission with budgets on: unknown objectives are the default, the budget
    accounts (and so the budget keys shipped to Redis) and their series stay bounded."""
    router = await make_router()
    router.config = parse_config(
        {
            **BASE,
            "budgets": {"default": {"rpm": 1_000_000}, "tenants": {"paying": {"rpm": 100}}},
            "request": {"trusted_headers": True, "objectives": {"gold": 5}},
        }
    )
    bound = router.flow.bound
    body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    policy = router.config.request
    for i in range(10_000):
        headers = {
            "x-gateway-inference-fairness-id": f"tenant-{i}",
            "x-priority": str(i),
            "x-gateway-inference-objective": f"objective-{i}",
        }
        request = parse_request("/v1/completions", headers, body, policy)
        assert request.objective == ""  # unknown objectives are the default
        await router.admit(RequestContext(router.generation), request)
    flows = {tenant for tenant, _ in router.budgets.accounts()}
    assert len(flows) <= bound._flows.limit + 1
    assert OTHER_FLOW in flows
    assert len(bound._priorities.current) <= bound._priorities.limit
    # Budget labels: configured names and 'default' only (other tests add their own names).
    tenants = {s["tenant"] for s in series("epp_budget_admitted")}
    assert "default" in tenants
    assert not [t for t in tenants if t.startswith("tenant-") or t == OTHER_FLOW]


async def test_queue_size_series_name_configured_values_and_vanish_with_their_queue() -> None:
    router = await make_router()
    controller = router.flow
    controller.bound.configure(["paying"], [5])
    controller._count(("tiny", "5", "paying"), 1)
    controller._count(("tiny", "other", "other"), 1)
    name = "inference_extension_flow_control_queue_size"
    assert {(s["priority"], s["fairness_id"]) for s in series(name)} >= {
        ("5", "paying"),
        ("other", "other"),
    }
    assert controller.bound.flow_label("tenant-123") == "other"
    controller._count(("tiny", "5", "paying"), -1)
    controller._count(("tiny", "other", "other"), -1)
    assert not [s for s in series(name) if s.get("inference_pool") == "tiny"]


# ---------------------------------------------------------------------------- buffered bodies


def _budgeted(router_config: dict[str, object]) -> dict[str, object]:
    return {**BASE, "routing": {"max_body_bytes": 10_000}, "server": router_config}


async def test_bodies_beyond_the_buffered_budget_are_refused_with_503_json() -> None:
    router = await make_router()
    # Streams other tests left open count too: the budget is 1000 bytes beyond them.
    base = buffered.held()
    router.config = parse_config(_budgeted({"max_buffered_bytes": base + 1000}))
    first, second = StreamHandler(router), StreamHandler(router)
    first.handle(headers_msg())
    assert first.handle(body_msg(b"x" * 600, eos=False))  # held, acknowledged
    assert buffered.held() == base + 600
    second.handle(headers_msg())
    (refused,) = second.handle(body_msg(b"y" * 600, eos=False))
    assert refused.immediate_response.status.code == 503
    error = json.loads(refused.immediate_response.body)["error"]
    assert error["code"] == "buffer_full"
    retry = {
        h.header.key: h.header.raw_value for h in refused.immediate_response.headers.set_headers
    }
    assert retry["retry-after"] == b"1"
    assert buffered.held() == base + 600  # the refused body was not kept
    # A declared length that does not fit is refused at the headers, before any upload.
    third = StreamHandler(router)
    (early,) = third.handle(headers_msg(extra={"content-length": "500"}))
    assert early.immediate_response.status.code == 503
    # The first stream ends: its bytes are given back and a body fits again.
    first.close()
    assert buffered.held() == base
    fourth = StreamHandler(router)
    fourth.handle(headers_msg())
    (routed,) = fourth.handle(body_msg(BODY))
    assert routed.WhichOneof("response") == "request_body"
    fourth.settle()
    assert buffered.held() == base
    fourth.close()


async def test_without_a_budget_nothing_is_refused() -> None:
    router = await make_router()
    router.config = parse_config(_budgeted({"max_buffered_bytes": 0}))
    base = buffered.held()
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    answer = handler.handle(body_msg(b"z" * 5000, eos=False))
    assert not any(a.HasField("immediate_response") for a in answer)
    assert buffered.held() == base + 5000
    handler.close()
    assert buffered.held() == base
