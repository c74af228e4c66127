"""What epp adds to a request's latency through Envoy, measured side by side in one run.

Four set-ups share one backend (an Envoy ``direct_response`` listener that answers like a vLLM
replica, so the backend costs almost nothing) and one load generator (wrk):

- ``envoy``: Envoy routes straight to the backend; no ext_proc.
- ``noop``: Envoy + a no-op Python ext_proc that returns a fixed destination unread.
- ``floor``: Envoy + the least work any Python picker must do (``benchmarks/floor_extproc.py``:
  read the headers, parse the body once, pick in turn, answer like epp).
- ``epp``: Envoy + epp, which parses the OpenAI body and schedules over 3 scraped endpoints.

For each body mode (buffered, full-duplex), prompt size (1 KB, 8 KB, 200 KB) and concurrency (1,
32) it records p50/p99 latency and requests/s, prints a table and writes it to
``benchmarks/results/overhead.md`` (``--output``); docs/overhead.md, written by hand, reads it.
Usage: ``python -m benchmarks.overhead [--duration 5] [--rounds 3] [--quick] [--before DIR]``;
``--before`` runs a second worktree's epp alongside (e.g. the base commit of a change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml

from epp.config import Config, load_config, parse_config
from epp.devstack import Proc, envoy_binary, free_port, http_ok
from epp.envoy_config import Mode, ext_proc_settings, render

ROOT = Path(__file__).resolve().parent.parent
METRICS_PAGE = (
    'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0\n'
)
COMPLETION = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
SIZES = {"1KB": 1024, "8KB": 8 * 1024, "200KB": 200 * 1024}


HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _listener(name: str, port: int, routes: list[dict[str, Any]]) -> dict[str, Any]:
    """An HTTP listener with one virtual host and the router filter."""
    hcm = {
        "@type": HCM + "HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {"virtual_hosts": [{"name": name, "domains": ["*"], "routes": routes}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    return {
        "name": name,
        "address": _address(port),
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _bootstrap(admin: int, **resources: Any) -> str:
    return yaml.safe_dump({"admin": {"address": _address(admin)}, "static_resources": resources})


def backend_config(ports: list[int], admin: int) -> str:
    """One Envoy serving several fake replicas: /metrics and completions, no real work."""
    listeners = []
    for port in ports:
        routes = [
            {
                "match": {"prefix": "/metrics"},
                "direct_response": {"status": 200, "body": {"inline_string": METRICS_PAGE}},
            },
            {
                "match": {"prefix": "/"},
                "direct_response": {"status": 200, "body": {"inline_string": COMPLETION}},
                "response_headers_to_add": [
                    {"header": {"key": "x-served-by", "value": f"127.0.0.1:{port}"}}
                ],
            },
        ]
        listeners.append(_listener(f"b{port}", port, routes))
    return _bootstrap(admin, listeners=listeners)


def plain_config(listen: int, admin: int, backend: int) -> str:
    """Envoy routing straight to one backend: the no-ext_proc baseline."""
    route = {"match": {"prefix": "/"}, "route": {"cluster": "backend", "timeout": "0s"}}
    cluster = {
        "name": "backend",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "backend",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(backend)}}]}],
        },
    }
    return _bootstrap(admin, listeners=[_listener("front", listen, [route])], clusters=[cluster])


@dataclass
class Result:
    setup: str
    mode: str
    size: str
    concurrency: int
    p50_ms: float
    p99_ms: float
    rps: float
    errors: int
    # CPU time of the ext_proc server per request, µs (0 for plain Envoy).
    cpu_us: float


def wrk(
    url: str, body_file: Path, concurrency: int, duration: float, workdir: Path
) -> tuple[float, float, float, int]:
    script = workdir / "post.lua"
    script.write_text(
        f"local f = io.open({str(body_file)!r}, 'rb'); wrk.body = f:read('*a'); f:close()\n"
        "wrk.method = 'POST'\nwrk.headers['content-type'] = 'application/json'\n"
        "done = function(summary, latency, requests)\n"
        "  io.write(string.format('P50 %d\\nP99 %d\\nREQS %d\\nERRS %d\\n',"
        " latency:percentile(50), latency:percentile(99), summary.requests,"
        " summary.errors.status + summary.errors.connect + summary.errors.read"
        " + summary.errors.write + summary.errors.timeout))\nend\n"
    )
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{int(duration)}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            f"{url}/v1/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    values = dict(re.findall(r"^(P50|P99|REQS|ERRS) (\d+)$", out, re.MULTILINE))
    return (
        int(values["P50"]) / 1000,
        int(values["P99"]) / 1000,
        int(values["REQS"]) / duration,
        int(values["ERRS"]),
    )


class Bench:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []

    def spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc.start(name, argv, self.workdir)
        self.procs.append(proc)
        return proc

    def wait(self, what: str, check: object, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():  # type: ignore[operator]
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} died; log {p.log}:\n{p.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def stop(self, proc: Proc) -> None:
        proc.stop()
        self.procs.remove(proc)

    def envoy(self, name: str, config: str, admin: int) -> Proc:
        path = self.workdir / f"{name}.yaml"
        path.write_text(config)
        proc = self.spawn(
            name,
            [
                envoy_binary(),
                "-c",
                str(path),
                "--log-level",
                "error",
                "--base-id",
                str(admin),
                "--concurrency",
                "1",
            ],
        )
        self.wait(name, lambda: http_ok(f"http://127.0.0.1:{admin}/ready"))
        return proc


def epp_argv(
    python: str, config_path: Path, grpc_port: int, health: int, metrics: int
) -> list[str]:
    # -P: import epp from the interpreter's own install, never from the current directory, so
    # a --before worktree's Python runs that worktree's code.
    return [
        python,
        "-P",
        "-m",
        "epp",
        "serve",
        "-c",
        str(config_path),
        "--port",
        str(grpc_port),
        "--health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        "--log-level",
        "warning",
    ]


# The Python ext_proc servers measured beside epp, run with -m from the repository.
BASELINES = {"noop": "benchmarks.noop_extproc", "floor": "benchmarks.floor_extproc"}


def pool_config(backends: list[int]) -> dict[str, Any]:
    """epp's configuration for the backend's replicas (model ``tiny``, pool ``main``)."""
    return {
        "models": {"tiny": {"pools": ["main"]}},
        "pools": {"main": {"endpoints": [f"127.0.0.1:{p}" for p in backends]}},
        "server": {"host": "127.0.0.1"},
        "routing": {"max_body_bytes": 4 * 1024 * 1024},
    }


def front_config(config: Config, mode: str, grpc_port: int, health: int) -> tuple[str, int, int]:
    """A front Envoy's bootstrap as `epp envoy-config` renders it for ``mode``, with the ext_proc
    server at ``grpc_port`` (health on ``health``); with its listener and admin ports."""
    listen, admin = free_port(), free_port()
    rendered = render(
        config,
        mode=cast(Mode, mode),
        listen=f"127.0.0.1:{listen}",
        admin=f"127.0.0.1:{admin}",
        extproc=[f"127.0.0.1:{grpc_port}"],
        health=[f"127.0.0.1:{health}"],
    )
    return rendered, listen, admin


def start_setup(
    bench: Bench,
    setup: str,
    mode: str,
    config_path: Path,
    python: str,
    probe: bytes,
    extra: Sequence[str] = (),
) -> tuple[Proc, int]:
    """Start ``setup``'s ext_proc server (a :data:`BASELINES` server, given the arguments
    ``extra`` too, or epp run by ``python`` with the configuration at ``config_path``) and its
    front Envoy as `epp envoy-config` renders it for ``mode``; return the server and the
    front's port once ``probe`` (a completion request) routes to a replica."""
    config = load_config(config_path)
    grpc_port, health, metrics = free_port(), free_port(), free_port()
    if setup in BASELINES:
        # The no-op routes everything to the first replica; the floor picks among all of them.
        endpoints = config.pools["main"]
        argv = [sys.executable, "-m", BASELINES[setup], "--port", str(grpc_port)]
        for endpoint in endpoints[:1] if setup == "noop" else endpoints:
            argv += ["--destination", endpoint]
        argv += extra
        server = bench.spawn(f"{setup}-{mode}", argv)
    else:
        argv = epp_argv(python, config_path, grpc_port, health, metrics)
        server = bench.spawn(f"{setup}-{mode}", argv)
        bench.wait(setup, lambda: http_ok(f"http://127.0.0.1:{metrics}/metrics"))
    rendered, listen, admin = front_config(config, mode, grpc_port, health)
    bench.envoy(f"front-{setup}-{mode}", rendered, admin)
    # Wait until a real request routes (epp needs its first scrape).
    bench.wait("first routed request", lambda: _post_ok(listen, "/v1/completions", probe))
    return server, listen


IDLE_SECONDS = 3.0


def run(
    args: argparse.Namespace,
) -> tuple[list[Result], list[StreamResult], dict[str, float]]:
    """Per body mode, every set-up runs at once behind its own front Envoy; each measurement
    point then runs the set-ups back to back (``--rounds`` times, alternating), so slow drifts
    of the shared machine hit them alike."""
    if shutil.which("wrk") is None:
        sys.exit("overhead: needs wrk (apt-get install wrk) as the load generator")
    workdir = Path(tempfile.mkdtemp(prefix="epp-overhead-"))
    bench = Bench(workdir)
    results: list[Result] = []
    idle: dict[str, float] = {}
    bodies = {}
    for label, length in SIZES.items():
        prompt = ("lorem ipsum dolor sit amet " * (length // 27 + 1))[:length]
        path = workdir / f"body-{label}.json"
        path.write_text(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}))
        bodies[label] = path
    backends = [free_port() for _ in range(3)]
    pythons = {"epp": sys.executable}
    if args.before:
        pythons = {"before": str(Path(args.before) / ".venv" / "bin" / "python"), **pythons}
    try:
        bench.envoy(
            "backend", backend_config(backends, free_port_admin := free_port()), free_port_admin
        )
        config_path = workdir / "epp.yaml"
        config_path.write_text(yaml.safe_dump(pool_config(backends)))
        modes = ["buffered"] if args.quick else ["buffered", "full-duplex"]
        sizes = args.size or list(SIZES)
        for mode in modes if args.part != "streaming" else []:
            fronts: dict[str, int] = {}
            servers: dict[str, Proc] = {}
            if mode == modes[0]:
                listen, admin = free_port(), free_port()
                bench.envoy("envoy", plain_config(listen, admin, backends[0]), admin)
                fronts["envoy"] = listen
            for setup in ["noop", "floor", *pythons]:
                servers[setup], fronts[setup] = start_setup(
                    bench,
                    setup,
                    mode,
                    config_path,
                    pythons.get(setup, sys.executable),
                    bodies["1KB"].read_bytes(),
                )
            # Background work (scrapes, health checks) costs CPU with no request at all.
            before_idle = {setup: cpu_seconds(proc.popen.pid) for setup, proc in servers.items()}
            time.sleep(IDLE_SECONDS)
            for setup, proc in servers.items():
                spent = cpu_seconds(proc.popen.pid) - before_idle[setup]
                idle[f"{setup} ({mode})"] = spent / IDLE_SECONDS
            for size in sizes:
                for conc in (1, 32):
                    rows: dict[str, list[Run]] = {}
                    for _ in range(args.rounds):
                        for setup, port in fronts.items():
                            url = f"http://127.0.0.1:{port}"
                            wrk(url, bodies[size], conc, 1, workdir)  # warm-up
                            spy = None
                            if args.profile and setup in ("epp", "floor") and conc > 1:
                                pid = servers[setup].popen.pid
                                out = Path(args.profile) / f"{setup}-{mode}-{size}.txt"
                                spy = profiler(pid, out, args.duration)
                            server = servers.get(setup)
                            cpu = cpu_seconds(server.popen.pid) if server else 0.0
                            p50, p99, rps, errs = wrk(
                                url, bodies[size], conc, args.duration, workdir
                            )
                            if server is not None:
                                cpu = (cpu_seconds(server.popen.pid) - cpu) / (rps * args.duration)
                            rows.setdefault(setup, []).append((p50, p99, rps, errs, cpu * 1e6))
                            if spy is not None:
                                spy.wait()
                    for setup, runs in rows.items():
                        result = Result(
                            setup,
                            "-" if setup == "envoy" else mode,
                            size,
                            conc,
                            *_median_run(runs),
                        )
                        print(
                            f"  {setup:6} {mode:11} {size:>5} c={conc:<2}"
                            f" p50 {result.p50_ms:6.2f} ms  p99 {result.p99_ms:6.2f} ms"
                            f"  {result.rps:7.0f} req/s  cpu {result.cpu_us:5.0f} µs/req"
                            f"  errors {result.errors}",
                            flush=True,
                        )
                        results.append(result)
            for proc in list(bench.procs):
                if proc.name != "backend" and proc.name != "envoy":
                    bench.stop(proc)
        streams = streaming(args, bench, workdir) if args.part != "requests" else []
    finally:
        for p in list(bench.procs):
            p.stop()
    return results, streams, idle


@dataclass
class StreamResult:
    mode: str
    # "on": the response path as rendered; "off": response headers and body not sent to epp.
    response: str
    requests_per_s: float
    tokens_per_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    failed: int
    # epp's CPU time per streamed token, µs.
    cpu_us_per_token: float


def response_off(rendered: str) -> str:
    """The rendered bootstrap without response processing (epp before issue 16): response
    headers and body skipped; trailers still sent, so the stream lives as long as the response."""
    boot = yaml.safe_load(rendered)
    for settings in ext_proc_settings(boot):
        settings["processing_mode"]["response_header_mode"] = "SKIP"
        settings["processing_mode"]["response_body_mode"] = "NONE"
    return yaml.safe_dump(boot, sort_keys=False)


def streaming(args: argparse.Namespace, bench: Bench, workdir: Path) -> list[StreamResult]:
    """Streamed chat completions (a token every ``--stream-interval-ms``) at concurrency 32
    through epp with response processing on and off, side by side, per body mode."""
    replica = free_port()
    bench.spawn(
        "stream-replica",
        [
            sys.executable,
            "-m",
            "benchmarks.stream_replica",
            "--port",
            str(replica),
            "--tokens",
            str(args.stream_tokens),
            "--interval-ms",
            str(args.stream_interval_ms),
        ],
    )
    bench.wait("stream replica", lambda: http_ok(f"http://127.0.0.1:{replica}/metrics"))
    epp_config = {
        "models": {"stream": {"pools": ["stream"]}},
        "pools": {"stream": {"endpoints": [f"127.0.0.1:{replica}"]}},
        "server": {"host": "127.0.0.1"},
    }
    config_path = workdir / "epp-stream.yaml"
    config_path.write_text(yaml.safe_dump(epp_config))
    config = parse_config(epp_config)
    results = []
    modes = ["buffered"] if args.quick else ["buffered", "full-duplex"]
    for mode in modes:
        fronts: dict[str, tuple[int, Proc]] = {}
        for variant in ("off", "on"):
            grpc_port, health, metrics = free_port(), free_port(), free_port()
            argv = epp_argv(sys.executable, config_path, grpc_port, health, metrics)
            server = bench.spawn(f"epp-stream-{variant}-{mode}", argv)
            bench.wait("epp", lambda m=metrics: http_ok(f"http://127.0.0.1:{m}/metrics"))
            rendered, listen, admin = front_config(config, mode, grpc_port, health)
            if variant == "off":
                rendered = response_off(rendered)
            bench.envoy(f"front-stream-{variant}-{mode}", rendered, admin)
            bench.wait(
                "a routed stream",
                lambda p=listen: _post_ok(p, "/v1/chat/completions", STREAM_PROBE, 5.0),
            )
            fronts[variant] = (listen, server)
        runs: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for variant, (port, server) in fronts.items():
                cpu = cpu_seconds(server.popen.pid)
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.stream_client",
                        "--url",
                        f"http://127.0.0.1:{port}",
                        "--concurrency",
                        "32",
                        "--duration",
                        str(args.duration),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                row = json.loads(out)
                spent = cpu_seconds(server.popen.pid) - cpu
                row["cpu"] = spent / max(1.0, row["tokens_per_s"] * args.duration) * 1e6
                runs.setdefault(variant, []).append(row)
        for variant, rows in runs.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            result = StreamResult(
                mode,
                variant,
                med["requests_per_s"],
                med["tokens_per_s"],
                med["itl_p50_ms"],
                med["itl_p99_ms"],
                int(sum(r["failed"] for r in rows)),
                med["cpu"],
            )
            print(f"  stream {mode:11} response {variant:3} {result}", flush=True)
            results.append(result)
        for _, proc in fronts.values():
            bench.stop(proc)
        for proc in list(bench.procs):
            if proc.name.startswith("front-stream"):
                bench.stop(proc)
    return results


def profiler(pid: int, out: Path, seconds: int) -> subprocess.Popen[bytes]:
    """py-spy (a dev dependency) sampling ``pid`` for ``seconds``: collapsed stacks to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).parent / "py-spy")
    argv = [spy, "record", "-p", str(pid), "-d", str(seconds), "-f", "raw", "-o", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# One wrk run: p50 ms, p99 ms, requests/s, errors, ext_proc CPU µs per request.
Run = tuple[float, float, float, int, float]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (Linux /proc)."""
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds of a /proc ``stat`` line (a process's or one thread's)."""
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# A streamed chat request the streaming set-up's replica answers (readiness probe).
STREAM_PROBE = json.dumps(
    {"model": "stream", "messages": [{"role": "user", "content": "go"}]}
).encode()


def _median_run(runs: list[Run]) -> Run:
    """Per statistic, the median over rounds; errors summed."""
    return (
        statistics.median(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
        statistics.median(r[2] for r in runs),
        sum(r[3] for r in runs),
        statistics.median(r[4] for r in runs),
    )


def _post_ok(port: int, path: str, data: bytes, timeout: float = 1.0) -> bool:
    """Whether a POST of ``data`` to ``path`` through the front Envoy on ``port`` answers 200."""
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status: int = resp.status
            return status == 200
    except OSError:
        return False


# Issue 18's targets: c=32 requests/s as a share of the no-op's; sequential p50 over the no-op.
RPS_TARGET = 0.8
P50_TARGET_MS = {"1KB": 0.3, "8KB": 0.3, "200KB": 1.0}


# Issue 16's targets for response processing: inter-token latency p99 added, throughput kept.
ITL_P99_TARGET_MS = 1.0
THROUGHPUT_TARGET = 0.85


def stream_report(streams: list[StreamResult], args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        "## Streaming: response processing on and off",
        "",
        f"Streamed chat completions at concurrency 32 through epp, {args.stream_tokens} tokens "
        f"a response, one every {args.stream_interval_ms:g} ms from a replica that only streams "
        "(`benchmarks/stream_replica.py`; client `benchmarks/stream_client.py`, one connection "
        "a request). `on` is the response path as rendered (response headers and every body "
        "chunk through epp), `off` the same bootstrap with response headers and body skipped; "
        "both run at once, alternating, same rounds and duration as above. Inter-token latency "
        "(ITL) is the gap between token arrivals at the client; `epp cpu µs/token` is epp's "
        "CPU time per streamed token.",
        "",
        "| mode | response | req/s | tokens/s | ITL p50 ms | ITL p99 ms | failed "
        "| epp cpu µs/token | targets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in sorted({r.mode for r in streams}):
        off = next((r for r in streams if r.mode == mode and r.response == "off"), None)
        for r in (r for r in streams if r.mode == mode):
            verdict = ""
            if r.response == "on" and off is not None:
                added = r.itl_p99_ms - off.itl_p99_ms
                share = r.tokens_per_s / off.tokens_per_s if off.tokens_per_s else 0.0
                verdict = (
                    f"ITL p99 {added:+.2f} ms (≤ +{ITL_P99_TARGET_MS:g}): "
                    + ("met" if added <= ITL_P99_TARGET_MS else "missed")
                    + f"; throughput {share:.0%} of off (≥ {THROUGHPUT_TARGET:.0%}): "
                    + ("met" if share >= THROUGHPUT_TARGET else "missed")
                )
            lines.append(
                f"| {r.mode} | {r.response} | {r.requests_per_s:.1f} | {r.tokens_per_s:.0f} "
                f"| {r.itl_p50_ms:.2f} | {r.itl_p99_ms:.2f} | {r.failed} "
                f"| {r.cpu_us_per_token:.0f} | {verdict} |"
            )
    return lines


def verdict(setup: Result, noop: Result) -> str:
    """Issue 18's target for a point, met or missed by ``setup`` against the no-op."""
    if setup.concurrency == 1:
        goal = P50_TARGET_MS[setup.size]
        met = setup.p50_ms - noop.p50_ms <= goal
        return f"Δ p50 ≤ {goal} ms: " + ("met" if met else "missed")
    met = setup.rps >= RPS_TARGET * noop.rps
    return f"share ≥ {RPS_TARGET:.0%}: " + ("met" if met else "missed")


def report(
    results: list[Result],
    streams: list[StreamResult],
    idle: dict[str, float],
    args: argparse.Namespace,
    load: str,
) -> str:
    def find(setup: str, mode: str, size: str, conc: int) -> Result | None:
        for r in results:
            if (r.setup, r.size, r.concurrency) == (setup, size, conc) and r.mode in (mode, "-"):
                return r
        return None

    before = bool(args.before)
    command = f"python -m benchmarks.overhead --duration {args.duration} --rounds {args.rounds}"
    command += " --quick" if args.quick else ""
    command += "".join(f" --size {size}" for size in args.size or [])
    command += f" --part {args.part}" if args.part != "all" else ""
    command += f" --before {args.before}" if args.before else ""
    command += f" --profile {args.profile}" if args.profile else ""
    lines = [
        "# Overhead of epp through Envoy",
        "",
        f"Generated by `{command}` on {platform.node()} ({platform.machine()}, 2 cores shared "
        "by Envoy, the ext_proc servers, the backend, wrk and other work), "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        + f"; machine load before the run: {load}.",
        "",
        "Per body mode every set-up runs at once behind its own front Envoy, against the same "
        "backend (an Envoy answering like a vLLM replica with no work), with the response path "
        "as `epp envoy-config` renders it (response headers and body sent to the processor; the "
        "no-op and the floor answer them unread). `floor` is the least work any picker must do "
        "(`benchmarks/floor_extproc.py`: read the headers, parse the JSON body once, pick the "
        "next replica in turn, answer like epp). Each point runs the set-ups back to back, "
        f"alternating, {args.rounds} round(s) of {args.duration} s; the median is shown. "
        "Latency in ms from wrk; `Δ p50` is epp (`floor Δ p50`: the floor) minus the no-op "
        "ext_proc; `share` is epp's requests/s over the no-op's (`floor share`: the floor's); "
        "`cpu µs/req` is the ext_proc server's CPU time (user + system) per request, the figure "
        "least disturbed by the machine's other load."
        + (" `before` is the same run of the base commit's epp (`--before`)." if before else ""),
        "",
    ]
    head = "| mode | prompt | conc | envoy p50 | noop p50 | floor p50 | floor Δ p50 |"
    head += " before p50 |" if before else ""
    head += " epp p50 | Δ p50 | noop p99 | epp p99 | envoy req/s | noop req/s |"
    head += " floor req/s | floor share |"
    head += " before req/s | before share |" if before else ""
    head += " epp req/s | share | floor target | target | noop cpu µs/req | floor cpu µs/req |"
    head += " before cpu µs/req |" if before else ""
    head += " epp cpu µs/req | errors |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    modes = sorted({r.mode for r in results if r.mode != "-"})
    for mode in modes:
        for size in SIZES:
            for conc in (1, 32):
                e, n, f, p = (find(s, mode, size, conc) for s in ("envoy", "noop", "floor", "epp"))
                b = find("before", mode, size, conc)
                if not (e and n and f and p) or (before and b is None):
                    continue
                row = f"| {mode} | {size} | {conc} | {e.p50_ms:.2f} | {n.p50_ms:.2f} |"
                row += f" {f.p50_ms:.2f} | {f.p50_ms - n.p50_ms:+.2f} |"
                row += f" {b.p50_ms:.2f} |" if b else ""
                row += f" {p.p50_ms:.2f} | {p.p50_ms - n.p50_ms:+.2f} | {n.p99_ms:.2f} |"
                row += f" {p.p99_ms:.2f} | {e.rps:.0f} | {n.rps:.0f} |"
                row += f" {f.rps:.0f} | {f.rps / n.rps:.0%} |"
                row += f" {b.rps:.0f} | {b.rps / n.rps:.0%} |" if b else ""
                errors = e.errors + n.errors + f.errors + p.errors + (b.errors if b else 0)
                row += f" {p.rps:.0f} | {p.rps / n.rps:.0%} | {verdict(f, n)} | {verdict(p, n)} |"
                row += f" {n.cpu_us:.0f} | {f.cpu_us:.0f} |"
                row += f" {b.cpu_us:.0f} |" if b else ""
                row += f" {p.cpu_us:.0f} | {errors} |"
                lines.append(row)
    if idle:
        busy = ", ".join(f"{name} {share:.1%}" for name, share in idle.items())
        lines += ["", f"CPU of each ext_proc server with no request ({IDLE_SECONDS:g} s): {busy}."]
    if streams:
        lines += stream_report(streams, args)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per measurement")
    parser.add_argument("--quick", action="store_true", help="buffered mode only")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per point")
    parser.add_argument("--part", choices=["all", "requests", "streaming"], default="all")
    parser.add_argument("--stream-tokens", type=int, default=50)
    parser.add_argument("--stream-interval-ms", type=float, default=5.0)
    parser.add_argument("--size", action="append", choices=list(SIZES), help="default: all")
    parser.add_argument(
        "--profile", help="directory for py-spy profiles of epp at each concurrency-32 point"
    )
    parser.add_argument(
        "--before", help="another worktree (bootstrapped) whose epp runs alongside, as 'before'"
    )
    parser.add_argument(
        "--output",
        default=str(ROOT / "benchmarks" / "results" / "overhead.md"),
        help="the generated report (never a hand-written document)",
    )
    args = parser.parse_args()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print("measuring (each line is one point) ...", flush=True)
    results, streams, idle = run(args)
    text = report(results, streams, idle, args, "load average " + " / ".join(load))
    print(text)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
