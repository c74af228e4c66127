"""The ``tracing`` section, the sampling decision, and that tracing off costs nothing: the
request path never imports OpenTelemetry nor keeps a trace (the spans themselves are checked
against a real OTLP receiver in tests/e2e/test_tracing.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from epp.config import ConfigError, parse_config
from epp.tracing import Tracing, TracingConfig

BASE = {"models": {"tiny": {"pools": ["main"]}}, "pools": {"main": {"endpoints": ["1.2.3.4:80"]}}}


def test_tracing_is_off_by_default_and_read_from_its_section() -> None:
    assert not parse_config(BASE).tracing.enabled
    config = parse_config(
        {
            **BASE,
            "tracing": {
                "endpoint": "http://collector:4318/v1/traces",
                "sample_ratio": 0.25,
                "service_name": "gateway-epp",
            },
        }
    ).tracing
    assert config == TracingConfig("http://collector:4318/v1/traces", 0.25, "gateway-epp")
    assert config.enabled


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ({"endpoint": "collector:4318"}, "tracing.endpoint: must be the collector's OTLP/HTTP"),
        ({"sample_ratio": 1.5}, "tracing.sample_ratio: must be a fraction in [0, 1]"),
        ({"sample_ratio": -0.1}, "tracing.sample_ratio: must be a fraction in [0, 1], got -0.1"),
        ({"service_name": ""}, "tracing.service_name: must not be empty"),
        ({"exporter": "grpc"}, "tracing.exporter: must be one of the known keys"),
    ],
)
def test_bad_tracing_settings_name_their_key(section: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "tracing": section})
    assert any(problem in e for e in info.value.errors), info.value.errors


def test_the_callers_sampled_flag_decides_before_the_ratio() -> None:
    # Nothing is exported: no trace is ended, so the unreachable endpoint is never called.
    tracing = Tracing(TracingConfig("http://127.0.0.1:9/v1/traces", sample_ratio=0.0))
    try:
        assert tracing.begin({":path": "/v1/completions"}) is None
        sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        assert tracing.begin({"traceparent": sampled}) is not None
        unsampled = sampled.removesuffix("01") + "00"
        assert tracing.begin({"traceparent": unsampled}) is None
    finally:
        tracing.shutdown()


def test_with_tracing_off_a_request_never_touches_opentelemetry() -> None:
    """In a fresh interpreter: a request routed and answered end to end without tracing
    configured leaves OpenTelemetry's tracing SDK and exporter unimported and no trace on the
    handler."""
    code = textwrap.dedent(
        """
        import asyncio, json, sys
        from epp.extproc.stream import StreamHandler
        from tests.unit.test_stream import body_msg, destination, headers_msg, make_router

        async def main():
            router = await make_router()
            handler = StreamHandler(router)
            handler.handle(headers_msg())
            body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
            (answer,) = handler.handle(body_msg(body))
            assert destination(answer, "request_body")[0].startswith("127.0.0.1:8002")
            assert handler.context.trace is None
            handler.close()

        asyncio.run(main())
        # (redis-py imports OpenTelemetry's metrics API for its own, unused, observability.)
        tracing = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.propagators")
        loaded = sorted(m for m in sys.modules if m.startswith(tracing))
        assert not loaded, loaded
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
