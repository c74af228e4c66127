"""What OpenTelemetry tracing (docs/tracing.md) costs per request, on vs off side by side.

Two figures, on decision_time.py's workload (64 endpoints, 32k-token prompts, the default
profile):

- decision time with the plugin laps recorded for a trace vs not (what tracing adds to the
  answer's critical path);
- the span work once the stream ends: a sampled request's root span, its steps and one span
  per plugin lap built and ended, on the calling thread, plus the batch processor encoding
  them to OTLP protobuf (the HTTP post itself is left out: a collector's network).

Usage: ``python -m benchmarks.tracing_overhead [--requests 1000] [--endpoints 64]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from benchmarks.decision_time import LOAD_VIEWS, endpoints, percentiles, profile, text_requests
from epp.metrics.plugin_clock import Lap
from epp.request import InferenceRequest
from epp.scheduling import Cycle
from epp.state import Snapshot
from epp.state.fleet import FleetState
from epp.tracing import Tracing, TracingConfig


class EncodingExporter(SpanExporter):
    """Encodes every batch as the OTLP/HTTP exporter would, then drops it."""

    def __init__(self) -> None:
        self.bytes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=64)
    args = parser.parse_args()
    rng = random.Random(1)
    views = [endpoints(args.endpoints, rng) for _ in range(LOAD_VIEWS)]
    both = text_requests(2 * args.requests, rng)
    warmup, requests = both[: args.requests], both[args.requests :]
    # One fleet per column (what a pick teaches must not favour the other column), each
    # warmed alike; the columns alternate request by request so noise falls on both.
    prof, snapshot = profile(256), Snapshot()
    fleet_off, fleet_on = FleetState(), FleetState()
    rotation = itertools.cycle(views)
    for request in warmup:
        view = next(rotation)
        prof.run(request, view, Cycle(snapshot, fleet_off), 2)
        prof.run(request, view, Cycle(snapshot, fleet_on), 2)

    off: list[int] = []
    on: list[int] = []
    laps_of: list[list[Lap]] = []
    clock = time.perf_counter_ns
    for i, request in enumerate(requests):
        view = next(rotation)
        laps: list[Lap] = []
        for traced in (i % 2 == 0, i % 2 == 1):
            start = clock()
            if traced:
                prof.run(request, view, Cycle(snapshot, fleet_on), 2, laps=laps)
            else:
                prof.run(request, view, Cycle(snapshot, fleet_off), 2)
            (on if traced else off).append(clock() - start)
        laps_of.append(laps)

    # Room for every span of the run: none dropped, all encoded (epp's default queue is 2048).
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", str(32 * len(requests)))
    tracing = Tracing(TracingConfig("http://127.0.0.1:9/v1/traces"))
    exporter = EncodingExporter()
    # Same provider and batch processor as epp's, with the encoding exporter swapped in.
    processor = tracing._provider._active_span_processor._span_processors[0]
    processor._batch_processor._exporter = exporter  # type: ignore[attr-defined]
    spans: list[int] = []
    cpu = time.process_time()
    for request, laps in zip(requests, laps_of, strict=True):
        start = clock()
        trace_request(tracing, request, laps)
        spans.append(clock() - start)
    tracing.shutdown()  # flushes: the encoding is in the CPU time below
    cpu_per_request = (time.process_time() - cpu) / len(requests) * 1e6

    off_p50, off_p99 = percentiles(off)
    on_p50, on_p99 = percentiles(on)
    span_p50, span_p99 = percentiles(spans)
    print(f"{args.endpoints} endpoints, {args.requests} requests, times in µs\n")
    print(f"{'':<44}{'p50':>8}{'p99':>8}")
    print(f"{'decision, tracing off':<44}{off_p50:>8.0f}{off_p99:>8.0f}")
    print(f"{'decision, laps recorded (tracing on)':<44}{on_p50:>8.0f}{on_p99:>8.0f}")
    print(f"{'ratio on/off':<44}{on_p50 / off_p50:>8.3f}{on_p99 / off_p99:>8.3f}")
    print(f"{'spans built at stream end (calling thread)':<44}{span_p50:>8.0f}{span_p99:>8.0f}")
    print(f"\nspans + OTLP encoding, CPU per traced request: {cpu_per_request:.0f} µs")
    print(f"encoded: {exporter.bytes / len(requests):.0f} bytes per request")


def trace_request(tracing: Tracing, request: InferenceRequest, laps: list[Lap]) -> None:
    """What epp does for one sampled request: begin at the headers, steps, end."""
    trace = tracing.begin({":method": "POST", ":path": request.path})
    assert trace is not None
    started = time.perf_counter()
    trace.step("epp.parse", started, {"epp.body_bytes": len(request.prompt)})
    trace.step("epp.schedule", started, {"epp.profile": "default"})
    trace.laps.extend(laps)
    trace.answered(200)
    trace.end()


if __name__ == "__main__":
    main()
