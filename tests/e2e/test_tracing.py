"""OpenTelemetry tracing end to end: real Envoy, real epp, simulated vLLM, and a real OTLP/HTTP
receiver that decodes the exported protobuf (tests/helpers/otlp.py).

A request carrying a W3C ``traceparent`` gets its decision as a child of the caller's span:
``epp.request`` with ``epp.parse``, ``epp.admission``, ``epp.schedule`` (one child per plugin)
and ``epp.response`` (TTFT, status, served endpoint) under it. A caller's unsampled flag is
honoured; a refusal is traced with its status.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from epp.devstack import Stack
from tests.e2e.client import request
from tests.e2e.conftest import make_stack
from tests.e2e.fleet import wait_until
from tests.helpers.otlp import OtlpReceiver, ReceivedSpan

SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
STATUS_ERROR = 2


@pytest.fixture(scope="module", params=["buffered", "full-duplex"])
def traced(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, OtlpReceiver]]:
    mode = request.param
    # The batch processor exports every 100 ms instead of every 5 s (read by the epp process).
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    with OtlpReceiver() as receiver:
        stack = make_stack(
            tmp_path_factory.mktemp(f"tracing-{mode}"),
            mode,
            "memory",
            config_extra={
                "tracing": {"endpoint": receiver.url, "service_name": "epp-e2e"},
                # Flow control on, so the request passes through admission's queue.
                "admission": {"mode": "queue"},
            },
        )
        try:
            stack.start()
            yield stack, receiver
        finally:
            stack.stop()
            if saved is None:
                os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
            else:
                os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


def traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def spans_of(receiver: OtlpReceiver, trace_id: str) -> dict[str, list[ReceivedSpan]]:
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in receiver.matching(lambda s: s.trace_id == trace_id):
        by_name.setdefault(span.name, []).append(span)
    return by_name


def print_tree(spans: list[ReceivedSpan], parent: str, depth: int = 0) -> None:
    """The trace as a collector shows it (visible with ``pytest -s``; docs/tracing.md)."""
    for span in sorted(spans, key=lambda s: s.start_ns):
        if span.parent_span_id == parent:
            shown = {
                k: v
                for k, v in span.attributes.items()
                if k.startswith(("http.response", "epp.served", "epp.ttft", "gen_ai.usage"))
            }
            took = (span.end_ns - span.start_ns) / 1e3
            print(f"{'  ' * depth}{span.name:<{44 - 2 * depth}} {took:>9.0f} µs  {shown or ''}")
            print_tree(spans, span.span_id, depth + 1)


def test_the_decision_joins_the_callers_trace(traced: tuple[Stack, OtlpReceiver]) -> None:
    stack, receiver = traced
    header, trace_id, parent_id = traceparent()
    reply = request(
        stack.url,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "trace me",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"traceparent": header},
    )
    assert reply.status == 200, reply.body
    served = reply.served_by
    assert served is not None

    wait_until(lambda: "epp.request" in spans_of(receiver, trace_id), 10, "the request span")
    spans = spans_of(receiver, trace_id)
    (root,) = spans["epp.request"]
    print_tree([s for group in spans.values() for s in group], parent_id)
    assert root.parent_span_id == parent_id
    assert root.kind == SERVER_KIND
    assert root.service == "epp-e2e"
    assert root.attributes["gen_ai.request.model"] == "tiny"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["epp.served_endpoint"] == served
    assert root.attributes["url.path"] == "/v1/completions"

    for name in ("epp.parse", "epp.admission", "epp.schedule", "epp.response"):
        (span,) = spans[name]
        assert span.parent_span_id == root.span_id, name
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns, name
    assert spans["epp.admission"][0].attributes["epp.admission.mode"] == "queue"
    schedule = spans["epp.schedule"][0]
    assert schedule.attributes["epp.endpoints"][0] == served
    response = spans["epp.response"][0].attributes
    assert response["http.response.status_code"] == 200
    assert response["epp.served_endpoint"] == served
    assert response["epp.ttft_seconds"] > 0
    assert response["gen_ai.usage.output_tokens"] == 4

    # Every plugin of the default profile ran inside the schedule span, but for the post-pick
    # bookkeeping, which runs after the answer went out: a child of the request after it.
    laps = [s for group in spans.values() for s in group if "epp.plugin.name" in s.attributes]
    plugins = {s.attributes["epp.plugin.name"]: s for s in laps}
    assert {"prefix-cache-scorer", "ttft-scorer", "max-score-picker"} <= set(plugins)
    for span in laps:
        if span.attributes["epp.plugin.extension_point"] == "post_pick":
            assert span.parent_span_id == root.span_id, span.name
            assert schedule.end_ns <= span.start_ns <= span.end_ns <= root.end_ns, span.name
        else:
            assert span.parent_span_id == schedule.span_id, span.name
            assert schedule.start_ns <= span.start_ns <= span.end_ns <= schedule.end_ns, span.name
    assert plugins["max-score-picker"].name == "picker max-score-picker"
    # One span per extension point a plugin runs at.
    for point in ("producer", "scorer", "post_pick"):
        assert f"{point} prefix-cache-scorer" in spans


def test_an_unsampled_caller_is_not_traced_and_a_refusal_is(
    traced: tuple[Stack, OtlpReceiver],
) -> None:
    stack, receiver = traced
    quiet, quiet_id, _ = traceparent(sampled=False)
    assert request(
        stack.url, "/v1/completions", {"model": "tiny", "prompt": "x"}, {"traceparent": quiet}
    ).status == (200)
    loud, loud_id, _ = traceparent()
    reply = request(
        stack.url, "/v1/completions", {"model": "nope", "prompt": "x"}, {"traceparent": loud}
    )
    assert reply.status == 404
    wait_until(lambda: "epp.request" in spans_of(receiver, loud_id), 10, "the refusal's span")
    spans = spans_of(receiver, loud_id)
    root = spans["epp.request"][0]
    assert root.attributes["http.response.status_code"] == 404
    assert "nope" in root.attributes["epp.refusal"]
    # parse_request knows the configured models: the parse step refused it.
    assert spans["epp.parse"][0].status_code == STATUS_ERROR
    assert "epp.schedule" not in spans
    # Exported in order: the unsampled request came first and left nothing.
    assert spans_of(receiver, quiet_id) == {}
