"""Model rewrite through the stream state machine, in both body modes: the forwarded body and
the schedule carry the target, the metrics both names, the explained decision the rule; a
change of the cluster's rules reaches the next stream, not one already open."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from epp._proto import ext_proc_pb2
from epp.config import parse_config
from epp.discovery.policy import ClusterPolicy
from epp.extproc.stream import StreamHandler
from epp.rewrite import Rule, Target
from epp.router import Router
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from tests.unit.test_stream import BUFFERED, FULL_DUPLEX, body_msg, headers_msg

ENDPOINT = "127.0.0.1:8001"
MODES = pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX], ids=["buffered", "fullduplex"])


async def make_router() -> Router:
    config = parse_config(
        {
            "models": {
                "chat": {"rewrite": [{"model": "chat-v1", "weight": 1}]},
                "chat-v1": {"pools": ["main"]},
                "chat-v2": {"pools": ["main"], "lora": True},
            },
            "pools": {"main": {"endpoints": [ENDPOINT]}},
            "routing": {"explain": True},
            "admission": {"mode": "off"},
            # A gateway in front sets the objective header (the objective test names one).
            "request": {"trusted_headers": True},
        }
    )
    store = MemoryStore()
    await store.put_endpoint(EndpointState(ENDPOINT, "main", True, EndpointMetrics(), 1.0))
    return Router(config, FleetState(store))


def send(
    handler: StreamHandler,
    mode: int,
    body: dict[str, Any],
    answered: list[ext_proc_pb2.ProcessingResponse] | None = None,
    **headers: str,
) -> dict[str, Any]:
    """Run one request through ``handler``; the body it forwards upstream (the routing answer
    appended to ``answered``)."""
    raw = json.dumps(body).encode()
    handler.handle(headers_msg(mode=mode, extra=headers))
    answers = handler.handle(body_msg(raw))
    if answered is not None:
        answered.append(answers[0])
    if mode == FULL_DUPLEX:
        sent = b"".join(
            a.request_body.response.body_mutation.streamed_response.body for a in answers[1:]
        )
    else:
        assert answers[0].WhichOneof("response") == "request_body", answers[0]
        mutation = answers[0].request_body.response.body_mutation
        sent = mutation.body if mutation.HasField("body") else raw
    handler.settle()
    result: dict[str, Any] = json.loads(sent)
    return result


def routed(model: str, target: str) -> float:
    labels = {"model_name": model, "target_model_name": target}
    return REGISTRY.get_sample_value("inference_objective_request_total", labels) or 0.0


@MODES
async def test_the_forwarded_body_and_the_schedule_carry_the_target(mode: int) -> None:
    router = await make_router()
    before = routed("chat", "chat-v1")
    handler = StreamHandler(router)
    body = {"model": "chat", "prompt": "hello", "max_tokens": 4, "extra": {"kept": [1, 2]}}
    answered: list[ext_proc_pb2.ProcessingResponse] = []
    sent = send(handler, mode, body, answered, **{"x-request-id": f"rw-{mode}"})
    assert sent == {**body, "model": "chat-v1"}
    request = handler.context.request
    assert request is not None
    assert request.model == "chat-v1"
    assert routed("chat", "chat-v1") == before + 1
    decision = router.decisions[f"rw-{mode}"]
    assert decision["model"] == "chat-v1"
    explained = {
        "model": "chat",
        "target": "chat-v1",
        "rule": "models.chat.rewrite",
        "sticky": False,
    }
    assert decision["rewrite"] == explained
    # The explain header (envoy.lb metadata) carries it beside the candidates' scores.
    lb = answered[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    header = json.loads(lb["x-epp-scores"].string_value)
    assert header["rewrite"] == explained
    assert header[ENDPOINT]["total"] == decision["scores"][ENDPOINT]["total"]


@MODES
async def test_a_model_no_rule_names_passes_unchanged(mode: int) -> None:
    router = await make_router()
    body = {"model": "chat-v1", "prompt": "hello"}
    handler = StreamHandler(router)
    assert send(handler, mode, body) == body
    assert handler.context.rewrite is None


@MODES
async def test_cluster_rules_reach_the_next_stream_and_lora_sees_the_target(mode: int) -> None:
    router = await make_router()
    open_before = StreamHandler(router)
    router.cluster = ClusterPolicy(
        rewrites=(Rule(("chat",), (Target("chat-v2", 1),), "InferenceModelRewrite d/c rules[0]"),)
    )
    after = StreamHandler(router)
    body = {"model": "chat", "prompt": "hello"}
    assert send(after, mode, body, **{"x-session-token": "s1"})["model"] == "chat-v2"
    assert after.context.rewrite is not None
    assert after.context.rewrite.sticky
    request = after.context.request
    assert request is not None
    assert request.lora == "chat-v2"
    # A stream open before the change keeps the rules it started with.
    assert send(open_before, mode, body)["model"] == "chat-v1"


async def test_an_unknown_model_is_still_404_naming_the_rewritten_ones() -> None:
    router = await make_router()
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    (answer,) = handler.handle(body_msg(json.dumps({"model": "nope", "prompt": "x"}).encode()))
    immediate = answer.immediate_response
    assert immediate.status.code == 404
    assert "chat" in immediate.body.decode()


async def test_a_cluster_objective_sets_the_priority() -> None:
    router = await make_router()
    header = {"x-gateway-inference-objective": "critical"}
    first = StreamHandler(router)
    send(first, BUFFERED, {"model": "chat-v1", "prompt": "x"}, **header)
    assert first.context.request is not None
    assert first.context.request.priority == 0
    router.cluster = ClusterPolicy(objectives={"critical": 7})
    second = StreamHandler(router)
    send(second, BUFFERED, {"model": "chat-v1", "prompt": "x"}, **header)
    assert second.context.request is not None
    assert second.context.request.priority == 7
    assert second.context.request.objective == "critical"


async def test_a_conflict_is_logged_once_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    router = await make_router()
    base = router.config
    conflict = ClusterPolicy(rewrites=(Rule(("chat",), (Target("chat-v2", 1),), "cluster"),))
    router.cluster = conflict
    router.config = base  # discovery or a reload rebuilds the generation: no new line
    router.cluster = conflict
    replaced = [r for r in caplog.records if "replaced by a rule from the cluster" in r.message]
    assert len(replaced) == 1
    router.cluster = ClusterPolicy()  # resolved, then back: said again
    router.cluster = conflict
    replaced = [r for r in caplog.records if "replaced by a rule from the cluster" in r.message]
    assert len(replaced) == 2


async def test_a_reload_changes_the_split_for_the_next_stream() -> None:
    router = await make_router()
    before = StreamHandler(router)
    data = router.config
    models = {**data.models, "chat": replace(data.models["chat"], rewrite=(Target("chat-v2"),))}
    router.config = replace(data, models=models)
    body = {"model": "chat", "prompt": "x"}
    assert send(StreamHandler(router), BUFFERED, body)["model"] == "chat-v2"
    assert send(before, BUFFERED, body)["model"] == "chat-v1"


async def test_a_match_all_rule_never_labels_the_clients_name() -> None:
    router = await make_router()
    router.cluster = ClusterPolicy(rewrites=(Rule((), (Target("chat-v1"),), "match-all"),))
    handler = StreamHandler(router)
    sent = send(handler, BUFFERED, {"model": "made-up-by-a-client", "prompt": "x"})
    assert sent["model"] == "chat-v1"
    assert routed("made-up-by-a-client", "chat-v1") == 0
    assert routed("*", "chat-v1") >= 1
