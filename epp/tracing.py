"""OpenTelemetry tracing of the decision, for users who run a collector (docs/tracing.md).

Off unless ``tracing.endpoint`` is set; then OpenTelemetry is imported and spans are exported
over OTLP/HTTP (protobuf) by a batch processor on its own thread. A sampled request gets:

- ``epp.request`` (server span, child of the gateway's span when the request carries a W3C
  ``traceparent``): method, path, model, the status the client got, the picked and served
  endpoints;
- ``epp.parse``, ``epp.admission`` (preparation and the flow-control queue, when the request
  went through them), ``epp.schedule`` (the profile) with one child span per plugin lap
  (producer, filter, scorer, picker), one span per post-pick hook (a child of the request:
  that bookkeeping runs after the answer has gone out), and ``epp.response`` (from the
  response headers to the end: status, served endpoint, TTFT, TPOT, token usage).

Cost: with tracing off, nothing of this module runs and no span object exists. With it on,
the request path only records timestamps (:class:`RequestTrace`); the spans are built with
those timestamps once the stream ends, after the answer has gone out.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.metrics.plugin_clock import Lap

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

Attributes = dict[str, Any]


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """The ``tracing`` section: where to export (empty: tracing off), which share of requests
    without a sampled parent to trace, and the ``service.name`` of the spans."""

    endpoint: str = ""
    sample_ratio: float = 1.0
    service_name: str = "epp"

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


class Tracing:
    """The tracer provider and its OTLP/HTTP exporter; one per process."""

    def __init__(self, config: TracingConfig) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            # A request that arrives with a traceparent follows its sampled flag.
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        # Batch size, delay and queue follow the OTEL_BSP_* variables; headers (a collector's
        # credentials) OTEL_EXPORTER_OTLP_HEADERS.
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint))
        )
        self._tracer: Tracer = self._provider.get_tracer("epp")
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, headers: Mapping[str, str]) -> RequestTrace | None:
        """The trace of a request whose headers just arrived, or None when it is not sampled."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        span = self._tracer.start_span(
            "epp.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": headers.get(":method", ""),
                "url.path": headers.get(":path", ""),
            },
        )
        if not span.is_recording():
            return None
        return RequestTrace(self._tracer, span)

    def shutdown(self) -> None:
        """Export what is still queued, then stop the exporter's thread."""
        self._provider.shutdown()


class RequestTrace:
    """Timestamps of one request's steps; :meth:`end` turns them into spans."""

    __slots__ = (
        "_epoch",
        "_error",
        "_perf",
        "_root",
        "_status",
        "_steps",
        "_tracer",
        "attributes",
        "laps",
        "response_started",
    )

    def __init__(self, tracer: Tracer, root: Span) -> None:
        self._tracer = tracer
        self._root = root
        # The root started now: perf_counter marks are placed on the wall clock from here.
        self._epoch = time.time_ns()
        self._perf = time.perf_counter()
        self._steps: list[tuple[str, float, float, Attributes, str | None]] = []
        self._status = 0
        self._error: str | None = None
        # Filled by the scheduling profile's clock while it runs (epp.metrics.plugin_clock).
        self.laps: list[Lap] = []
        # Attributes of the request span, added as the request goes.
        self.attributes: Attributes = {}
        # When the response headers arrived (perf_counter), if they did.
        self.response_started: float | None = None

    def step(
        self, name: str, started: float, attributes: Attributes, error: str | None = None
    ) -> None:
        """A step that started at ``started`` (perf_counter) ends now; ``error``: it refused
        the request, with this message."""
        self._steps.append((name, started, time.perf_counter(), attributes, error))

    def answered(self, status: int, error: str | None = None) -> None:
        """epp answered the request itself (a refusal with ``error``, or the model list)."""
        self._status = status
        self._error = error

    def end(self) -> None:
        """The stream ended: build and end every span."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        root = self._root
        context = set_span_in_context(root)
        schedule: Context | None = None
        for name, started, ended, attributes, error in self._steps:
            span = self._tracer.start_span(
                name, context=context, attributes=attributes, start_time=self._ns(started)
            )
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            if name == "epp.schedule":
                schedule = set_span_in_context(span)
            span.end(end_time=self._ns(ended))
        for point, plugin, started, ended in self.laps:
            self._tracer.start_span(
                f"{point} {plugin.name}",
                context=context if point == "post_pick" else schedule,
                attributes={
                    "epp.plugin.extension_point": point,
                    "epp.plugin.type": plugin.type_name,
                    "epp.plugin.name": plugin.name,
                },
                start_time=self._ns(started),
            ).end(end_time=self._ns(ended))
        status = self._status
        if status:
            self.attributes["http.response.status_code"] = status
        if self._error is not None:
            self.attributes["epp.refusal"] = self._error
        root.set_attributes(self.attributes)
        if status >= 500:
            # A 4xx is the client's problem, not an error of this (server) span.
            root.set_status(Status(StatusCode.ERROR, self._error))
        root.end()

    def responded(self, status: int, served: str | None, attributes: Attributes) -> None:
        """The replica's response ended (or was cut) with ``status``: its step ends now."""
        self._status = status
        if served is not None:
            self.attributes["epp.served_endpoint"] = served
        started = self.response_started
        self.step("epp.response", time.perf_counter() if started is None else started, attributes)

    def _ns(self, perf: float) -> int:
        return self._epoch + int((perf - self._perf) * 1e9)
