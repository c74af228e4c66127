"""``epp serve --workers N``: decision throughput with 1, 2 and 3 workers on one host, and the
replicas' prefix-cache hit rate against one process on the same load.

Throughput: one front Envoy (as ``epp envoy-config --workers N`` renders it: every worker an
endpoint of the ``epp`` cluster, round robin), one ``epp serve --workers N`` (the supervisor and
its workers, sharing state through Redis), three fake replicas (an Envoy answering /metrics and
completions instantly, from ``benchmarks/overhead.py``), wrk posting a 1 KB completion with 32
connections for ``--duration`` s, best of ``--repeat``. The profile scores prefix affinity and
load, so every pick also ships a prefix insertion to the other workers. CPU is read from /proc
for the workers and the front Envoy.

Hit rate: the e2e test's prefix groups (12 groups x 8 requests, tests/e2e/test_active_active.py)
through Envoy to simulated replicas with prefix caches, once with one ``epp serve`` on the
in-process store and once per worker count; the replicas' own counters give the hit rate.

Usage: ``python -m benchmarks.workers [--duration 4] [--repeat 2] [--workers 1 2 3]``; writes
``docs/workers-bench.md`` (the figures docs/workers.md quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.multi_epp import PROFILE, _picks, front_envoy
from benchmarks.overhead import Bench, backend_config, cpu_seconds, wrk
from epp.devstack import Proc, free_port, free_port_run, http_ok
from epp.workers import PORT_STRIDE, worker_ports
from tests.e2e.test_active_active import ha_stack, prefix_groups, stickiness
from tests.e2e.test_workers import workers_stack
from tests.helpers.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    workers: int
    rps: float
    p50: float
    p99: float
    shares: list[int]
    epp_cpu: float
    envoy_cpu: float
    errors: int


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def throughput(args: argparse.Namespace, redis_url: str, count: int, workdir: Path) -> Row:
    workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(workdir)
    body = workdir / "body.json"
    prompt = ("lorem ipsum dolor sit amet " * 40)[:1024]
    body.write_text(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}))
    backends = [free_port() for _ in range(3)]
    try:
        backend_admin = free_port()
        bench.envoy("backend", backend_config(backends, backend_admin), backend_admin)
        config = {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [f"127.0.0.1:{p}" for p in backends]}},
            "server": {"host": "127.0.0.1"},
            "scheduling": PROFILE,
            "store": {
                "backend": "redis",
                "redis_url": redis_url,
                "key_prefix": f"workers-{uuid.uuid4().hex[:8]}",
            },
        }
        path = workdir / f"epp-{count}.yaml"
        path.write_text(yaml.safe_dump(config))
        base = free_port_run(PORT_STRIDE * count)
        ports = worker_ports(base, base + 1, free_port_run(count), count)
        extproc, health, metrics = ports[0]
        parent = bench.spawn(
            f"epp-workers-{count}",
            [
                *(sys.executable, "-m", "epp", "serve", "-c", str(path)),
                *("--port", str(extproc), "--health-port", str(health)),
                *("--metrics-port", str(metrics), "--log-level", "warning"),
                *("--workers", str(count)),
            ],
        )
        for _, _, m in ports:
            bench.wait("worker", lambda m=m: http_ok(f"http://127.0.0.1:{m}/metrics"), 60)
        front, url = front_envoy(bench, config, ports)
        wrk(url, body, 32, 1, workdir)
        runs = [_loaded(args, url, body, workdir, ports, parent, front) for _ in range(args.repeat)]
        best = max(runs, key=lambda r: r.rps)
        best.workers = count
        best.errors = sum(r.errors for r in runs)
        return best
    finally:
        for proc in list(bench.procs):
            proc.stop()


def _loaded(
    args: argparse.Namespace,
    url: str,
    body: Path,
    workdir: Path,
    ports: list[tuple[int, int, int]],
    parent: Proc,
    front: Proc,
) -> Row:
    # With one worker `epp serve` routes in the parent itself (no supervisor, no children).
    pids = [*(children(parent.popen.pid) or [parent.popen.pid]), front.popen.pid]
    before_picks = _picks(ports)
    cpu_before, started = [cpu_seconds(p) for p in pids], time.monotonic()
    p50, p99, rps, errors = wrk(url, body, 32, args.duration, workdir)
    elapsed = time.monotonic() - started
    cpu = [(cpu_seconds(p) - c) / elapsed * 100 for p, c in zip(pids, cpu_before, strict=True)]
    shares = [b - a for a, b in zip(before_picks, _picks(ports), strict=True)]
    return Row(0, rps, p50, p99, shares, sum(cpu[:-1]), cpu[-1], errors)


def hit_rates(redis_url: str, counts: list[int], workdir: Path) -> list[tuple[str, float, float]]:
    """(set-up, replicas' prefix-cache hit rate, stickiness) for one process and each count."""
    out = []
    with ha_stack(workdir / "one", None, epps=1) as single:
        single.start()
        served, rate = prefix_groups(single)
        out.append(("1 process (in-process store)", rate, stickiness(served)))
    for count in counts:
        with workers_stack(workdir / f"w{count}", redis_url, workers=count) as stack:
            stack.start(timeout=60)
            served, rate = prefix_groups(stack)
            out.append((f"--workers {count} (Redis)", rate, stickiness(served)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="epp-workers-"))
    redis = RedisServer(workdir / "redis").start()
    load_before = os.getloadavg()
    try:
        rows = []
        for count in args.workers:
            row = throughput(args, redis.url, count, workdir / f"t{count}")
            rows.append(row)
            print(
                f"  workers {count}: {row.rps:.0f} decisions/s p50 {row.p50:.2f} ms p99 "
                f"{row.p99:.2f} ms | epp CPU {row.epp_cpu:.0f}% Envoy {row.envoy_cpu:.0f}% | "
                f"per worker {row.shares} | errors {row.errors}",
                flush=True,
            )
        rates = hit_rates(redis.url, [c for c in args.workers if c > 1], workdir)
        for name, rate, stick in rates:
            print(f"  {name}: hit rate {rate:.3f}, stickiness {stick:.3f}", flush=True)
    finally:
        redis.stop()
    load_after = os.getloadavg()
    base = rows[0].rps if rows else 0.0
    lines = [
        "# epp serve --workers: measured",
        "",
        f"`python -m benchmarks.workers --duration {args.duration:g} --repeat {args.repeat}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other work; 1-minute load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after). What it means: "
        "docs/workers.md.",
        "",
        "| workers | c=32 decisions/s | vs 1 worker | p50 ms | p99 ms | epp CPU % (all "
        "workers) | Envoy CPU % | decisions per worker | errors |",
        "|---|---|---|---|---|---|---|---|---|",
        *[
            f"| {r.workers} | {r.rps:.0f} | {r.rps / base:.2f}x | {r.p50:.2f} | {r.p99:.2f} "
            f"| {r.epp_cpu:.0f} | {r.envoy_cpu:.0f} | {' / '.join(map(str, r.shares))} "
            f"| {r.errors} |"
            for r in rows
        ],
        "",
        "| set-up | replicas' prefix-cache hit rate | stickiness |",
        "|---|---|---|",
        *[f"| {name} | {rate:.3f} | {stick:.3f} |" for name, rate, stick in rates],
        "",
    ]
    (ROOT / "docs" / "workers-bench.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
