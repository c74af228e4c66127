"""epp's own CPU per request, in process: the messages Envoy sends for one request through
:class:`~epp.extproc.stream.StreamHandler`, as the servicer drives it, without gRPC or Envoy.

The overhead benchmark (benchmarks/overhead.py) measures the whole process through Envoy, which
on a shared machine swings with everyone else's load; this one times only epp's Python per
request, with the process's CPU clock, so a change to the hot path shows even when the machine
is busy. Set-up as in the overhead benchmark: one model on three ready endpoints, the default
profile, the response path on (response headers, a JSON body with usage, trailers), the served
endpoint reported as Envoy reports it.

The no-op and floor ext_procs of the overhead benchmark (``benchmarks/noop_extproc.py``,
``benchmarks/floor_extproc.py``) are timed alike through their whole stream loop (epp's figure
is its handler without the servicer's loop around it), so the floor's column is the least any
picker's Python costs per request and the no-op's what the loop and answers cost without a
decision.

Usage: ``python -m benchmarks.handler_cpu [--requests 5000] [--repeat 5] [--streams 1]
[--before OTHER_WORKTREE]``; ``--before`` runs the same script with that worktree's interpreter
(its own epp) and prints both. ``--streams 32`` keeps 32 of epp's requests open at once with
their messages interleaved, as the server sees them at concurrency 32. The minimum over
``--repeat`` passes is shown (the least disturbed by other processes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import grpc

from epp._proto import core_pb2, ext_proc_pb2, processing_mode_pb2
from epp.config import parse_config
from epp.extproc.stream import StreamHandler
from epp.router import Router
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.wire import SERVED

SIZES = {"1KB": 1024, "8KB": 8 * 1024, "200KB": 200 * 1024}
MODES = {
    "buffered": (
        processing_mode_pb2.ProcessingMode.BUFFERED,
        processing_mode_pb2.ProcessingMode.STREAMED,
    ),
    "full-duplex": (
        processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
        processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
    ),
}
ENDPOINTS = [f"127.0.0.1:{9000 + i}" for i in range(3)]
COMPLETION = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()

Request = list[ext_proc_pb2.ProcessingRequest]
# Drives a batch of requests through the code timed.
Driver = Callable[[list[Request]], Awaitable[None]]


def _headers(values: dict[str, str]) -> core_pb2.HeaderMap:
    return core_pb2.HeaderMap(
        headers=[core_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )


def messages(i: int, body: bytes, mode: str) -> Request:
    """What Envoy sends for request ``i`` (the served-endpoint header is added once picked)."""
    request_mode, response_mode = MODES[mode]
    headers = ext_proc_pb2.ProcessingRequest(
        request_headers=ext_proc_pb2.HttpHeaders(
            headers=_headers(
                {
                    ":authority": "127.0.0.1:10000",
                    ":path": "/v1/completions",
                    ":method": "POST",
                    ":scheme": "http",
                    "user-agent": "wrk",
                    "content-type": "application/json",
                    "content-length": str(len(body)),
                    "x-forwarded-proto": "http",
                    "x-request-id": f"req-{i}",
                }
            )
        )
    )
    headers.protocol_config.request_body_mode = request_mode
    headers.protocol_config.response_body_mode = response_mode
    response_headers = {
        ":status": "200",
        "content-type": "application/json",
        "content-length": str(len(COMPLETION)),
        "date": "Wed, 25 Nov 2026 16:00:00 GMT",
        "server": "envoy",
    }
    return [
        headers,
        ext_proc_pb2.ProcessingRequest(
            request_body=ext_proc_pb2.HttpBody(body=body, end_of_stream=True)
        ),
        ext_proc_pb2.ProcessingRequest(
            response_headers=ext_proc_pb2.HttpHeaders(headers=_headers(response_headers))
        ),
        ext_proc_pb2.ProcessingRequest(
            response_body=ext_proc_pb2.HttpBody(body=COMPLETION, end_of_stream=True)
        ),
        ext_proc_pb2.ProcessingRequest(response_trailers=ext_proc_pb2.HttpTrailers()),
    ]


def drive(router: Router, batch: list[Request], streams: int = 1) -> None:
    """The servicer's loop: each message handled, its bookkeeping settled after the answers;
    at the stream's end settled, closed and released. With ``streams`` > 1, that many requests
    are open at once and their messages interleave one by one, as a server at that concurrency
    sees them (each stream's working set then competes for the caches with the others')."""
    for start in range(0, len(batch), streams):
        group = batch[start : start + streams]
        handlers = [StreamHandler(router) for _ in group]
        for step in range(len(group[0])):
            for handler, request in zip(handlers, group, strict=True):
                message = request[step]
                if message.HasField("response_headers") and handler.ticket is not None:
                    served = handler.ticket.endpoint.encode()
                    message.response_headers.headers.headers.add(key=SERVED, raw_value=served)
                handler.handle(message)
                handler.settle()
        for handler in handlers:
            handler.settle()
            handler.close()
            if handler.ticket is not None:
                router.finish(handler.ticket)


def completion_request(size: str) -> bytes:
    """A completions request whose prompt is ``size`` long."""
    length = SIZES[size]
    prompt = ("lorem ipsum dolor sit amet " * (length // 27 + 1))[:length]
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()


async def _best(size: str, mode: str, requests: int, repeat: int, run: Driver) -> float:
    """Minimum CPU µs per request of ``run`` over ``repeat`` passes (after one warm-up pass)."""
    body = completion_request(size)
    best = float("inf")
    for attempt in range(repeat + 1):
        batch = [messages(i, body, mode) for i in range(requests)]
        started = time.process_time()
        await run(batch)
        spent = (time.process_time() - started) / requests * 1e6
        if attempt:  # the first pass warms caches and the fleet state
            best = min(best, spent)
    return best


async def build_router(scheduling: Mapping[str, Any] | None = None) -> Router:
    """The benchmark's router: one model on three fresh, idle, ready endpoints; the default
    profile unless ``scheduling`` (the configuration's section) says otherwise."""
    raw: dict[str, Any] = {
        "models": {"tiny": {"pools": ["main"]}},
        "pools": {"main": {"endpoints": ENDPOINTS}},
        "routing": {"max_body_bytes": 4 * 1024 * 1024},
    }
    if scheduling is not None:
        raw["scheduling"] = scheduling
    config = parse_config(raw)
    store = MemoryStore()
    for address in ENDPOINTS:
        # Scraped "now" for the whole run: fresh, idle and ready.
        state = EndpointState(address, "main", True, EndpointMetrics(), time.time() + 3600)
        await store.put_endpoint(state)
    return Router(config, FleetState(store))


async def measure(size: str, mode: str, requests: int, repeat: int, streams: int = 1) -> float:
    """epp's handler: minimum CPU µs per request, ``streams`` requests open at once."""
    router = await build_router()

    async def run(batch: list[Request]) -> None:
        drive(router, batch, streams)

    return await _best(size, mode, requests, repeat, run)


async def _stream(request: Request) -> AsyncIterator[ext_proc_pb2.ProcessingRequest]:
    for message in request:
        yield message


async def measure_baseline(setup: str, size: str, mode: str, requests: int, repeat: int) -> float:
    """The overhead benchmark's no-op or floor ext_proc: its whole stream loop per request
    (the async generator gRPC drives, every answer), minimum CPU µs per request."""
    # Imported here: ``--before`` runs this file by path with -P under another worktree's
    # interpreter, where ``benchmarks`` is not importable (only epp's own figure is asked there).
    from benchmarks.floor_extproc import FloorProcessor
    from benchmarks.noop_extproc import NoopProcessor

    processor = NoopProcessor(ENDPOINTS[:1]) if setup == "noop" else FloorProcessor(ENDPOINTS)
    # Neither server uses its gRPC context.
    context = cast(grpc.aio.ServicerContext, None)

    async def run(batch: list[Request]) -> None:
        for request in batch:
            async for _ in processor.Process(_stream(request), context):
                pass

    return await _best(size, mode, requests, repeat, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--size", action="append", choices=list(SIZES), help="default: all")
    parser.add_argument("--mode", action="append", choices=list(MODES), help="default: both")
    parser.add_argument(
        "--streams",
        type=int,
        default=1,
        help="epp's requests open at once, their messages interleaved (default 1: one at a time)",
    )
    parser.add_argument("--before", help="another worktree (bootstrapped): its epp measured too")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = parser.parse_args()
    sizes = args.size or list(SIZES)
    modes = args.mode or list(MODES)
    ours = {
        f"{mode} {size}": asyncio.run(measure(size, mode, args.requests, args.repeat, args.streams))
        for mode in modes
        for size in sizes
    }
    if args.json:
        print(json.dumps(ours))
        return
    baselines = {
        (setup, f"{mode} {size}"): asyncio.run(
            measure_baseline(setup, size, mode, args.requests, args.repeat)
        )
        for setup in ("noop", "floor")
        for mode in modes
        for size in sizes
    }
    before: dict[str, float] = {}
    if args.before:
        argv = [str(Path(args.before) / ".venv" / "bin" / "python"), "-P", __file__, "--json"]
        argv += ["--requests", str(args.requests), "--repeat", str(args.repeat)]
        argv += ["--streams", str(args.streams)]
        argv += [f"--size={s}" for s in sizes] + [f"--mode={m}" for m in modes]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        before = json.loads(out.splitlines()[-1])
    print(
        "| mode, prompt | noop µs/req | floor µs/req |"
        + (" before µs/req |" if before else "")
        + " epp µs/req |"
    )
    print("|---|---|---|" + ("---|" if before else "") + "---|")
    for key, value in ours.items():
        old = f" {before[key]:.0f} |" if before else ""
        floor = f" {baselines['noop', key]:.0f} | {baselines['floor', key]:.0f} |"
        print(f"| {key} |{floor}{old} {value:.0f} |")


if __name__ == "__main__":
    main()
