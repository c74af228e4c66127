"""What epp adds to a request's latency through Envoy, measured side by side in one run.

Three set-ups share one backend (an Envoy ``direct_response`` listener that answers like a vLLM
replica, so the backend costs almost nothing) and one load generator (wrk):

- ``envoy``: Envoy routes straight to the backend; no ext_proc.
- ``noop``: Envoy + a no-op Python ext_proc that returns a fixed destination (the floor).
- ``epp``: Envoy + epp, which parses the OpenAI body and schedules over 3 scraped endpoints.

For each body mode (buffered, full-duplex), prompt size (1 KB, 8 KB, 200 KB) and concurrency (1,
32) it records p50/p99 latency and requests/s, prints a table and writes ``docs/overhead.md``.
Usage: ``python benchmarks/overhead.py [--duration 5] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml

from epp.config import parse_config
from epp.devstack import Proc, envoy_binary, free_port, http_ok
from epp.envoy_config import Mode, render

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


def run(args: argparse.Namespace) -> list[Result]:
    if shutil.which("wrk") is None:
        sys.exit("overhead: needs wrk (apt-get install wrk) as the load generator")
    workdir = Path(tempfile.mkdtemp(prefix="epp-overhead-"))
    bench = Bench(workdir)
    results: list[Result] = []
    bodies = {}
    for label, length in SIZES.items():
        prompt = ("lorem ipsum dolor sit amet " * (length // 27 + 1))[:length]
        path = workdir / f"body-{label}.json"
        path.write_text(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}))
        bodies[label] = path
    backends = [free_port() for _ in range(3)]
    try:
        bench.envoy(
            "backend", backend_config(backends, free_port_admin := free_port()), free_port_admin
        )
        epp_config = {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [f"127.0.0.1:{p}" for p in backends]}},
            "server": {"host": "127.0.0.1"},
            "routing": {"max_body_bytes": 4 * 1024 * 1024},
        }
        config_path = workdir / "epp.yaml"
        config_path.write_text(yaml.safe_dump(epp_config))
        config = parse_config(epp_config)
        listen, admin = free_port(), free_port()
        setups = ["envoy", "noop", "epp"]
        modes = ["buffered"] if args.quick else ["buffered", "full-duplex"]
        concurrencies = [1, 32]
        for setup in setups:
            for mode in modes if setup != "envoy" else ["-"]:
                grpc_port, health, metrics = free_port(), free_port(), free_port()
                if setup == "envoy":
                    front = bench.envoy("front", plain_config(listen, admin, backends[0]), admin)
                    server = None
                else:
                    if setup == "noop":
                        server = bench.spawn(
                            "noop",
                            [
                                sys.executable,
                                str(ROOT / "benchmarks" / "noop_extproc.py"),
                                "--port",
                                str(grpc_port),
                                "--destination",
                                f"127.0.0.1:{backends[0]}",
                            ],
                        )
                    else:
                        server = bench.spawn(
                            "epp",
                            [
                                sys.executable,
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
                            ],
                        )
                        bench.wait(
                            "epp", lambda m=metrics: http_ok(f"http://127.0.0.1:{m}/metrics")
                        )
                    front = bench.envoy(
                        "front",
                        render(
                            config,
                            # "-" labels only the plain-Envoy setup, which renders nothing here.
                            mode=cast(Mode, mode),
                            listen=f"127.0.0.1:{listen}",
                            admin=f"127.0.0.1:{admin}",
                            extproc=[f"127.0.0.1:{grpc_port}"],
                            health=[f"127.0.0.1:{health}"],
                        ),
                        admin,
                    )
                    # Wait until a real request routes (epp needs its first scrape).
                    bench.wait("first routed request", lambda: _post_ok(listen, bodies["1KB"]))
                for size, body in bodies.items():
                    for conc in concurrencies:
                        wrk(f"http://127.0.0.1:{listen}", body, conc, 1, workdir)  # warm-up
                        p50, p99, rps, errs = wrk(
                            f"http://127.0.0.1:{listen}", body, conc, args.duration, workdir
                        )
                        result = Result(setup, mode, size, conc, p50, p99, rps, errs)
                        print(
                            f"  {setup:5} {mode:11} {size:>5} c={conc:<2} p50 {p50:6.2f} ms"
                            f"  p99 {p99:6.2f} ms  {rps:7.0f} req/s  errors {errs}",
                            flush=True,
                        )
                        results.append(result)
                bench.stop(front)
                if server is not None:
                    bench.stop(server)
    finally:
        for p in list(bench.procs):
            p.stop()
    return results


def _post_ok(port: int, body: Path) -> bool:
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body.read_bytes(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=1) as resp:
            status: int = resp.status
            return status == 200
    except OSError:
        return False


def report(results: list[Result], args: argparse.Namespace) -> str:
    def find(setup: str, mode: str, size: str, conc: int) -> Result | None:
        for r in results:
            if (r.setup, r.size, r.concurrency) == (setup, size, conc) and r.mode in (mode, "-"):
                return r
        return None

    lines = [
        "# Overhead of epp through Envoy",
        "",
        f"Generated by `python benchmarks/overhead.py --duration {args.duration}` on "
        f"{platform.node()} ({platform.machine()}, 2 cores shared by Envoy, the ext_proc server, "
        "the backend and wrk), " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()) + ".",
        "",
        "All set-ups ran back to back in one run against the same backend (an Envoy answering "
        "like a vLLM replica with no work), so the differences are what each layer adds. "
        "Latency in ms from wrk; `Δ` columns are epp minus the no-op ext_proc at the same point.",
        "",
        "| mode | prompt | conc | envoy p50 | noop p50 | epp p50 | Δ p50 | noop p99 | epp p99 "
        "| envoy req/s | noop req/s | epp req/s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    modes = sorted({r.mode for r in results if r.mode != "-"})
    for mode in modes:
        for size in SIZES:
            for conc in (1, 32):
                e, n, p = (find(s, mode, size, conc) for s in ("envoy", "noop", "epp"))
                if not (e and n and p):
                    continue
                lines.append(
                    f"| {mode} | {size} | {conc} | {e.p50_ms:.2f} | {n.p50_ms:.2f} "
                    f"| {p.p50_ms:.2f} "
                    f"| {p.p50_ms - n.p50_ms:+.2f} | {n.p99_ms:.2f} | {p.p99_ms:.2f} | {e.rps:.0f} "
                    f"| {n.rps:.0f} | {p.rps:.0f} | {e.errors + n.errors + p.errors} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per measurement")
    parser.add_argument("--quick", action="store_true", help="buffered mode only")
    parser.add_argument("--output", default=str(ROOT / "docs" / "overhead.md"))
    args = parser.parse_args()
    print("measuring (each line is one wrk run) ...", flush=True)
    results = run(args)
    text = report(results, args)
    print(text)
    Path(args.output).write_text(text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
