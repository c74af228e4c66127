"""What a microsecond of per-request Python work costs a gRPC ext_proc server under load.

Beside the no-op ext_proc and epp, each behind its own front Envoy as the overhead benchmark
sets them up (``benchmarks/overhead.py``: one backend answering like a vLLM replica, the
response path as `epp envoy-config` renders it), it runs the no-op with ``--spin-us N``: the
same server burning N µs of CPU per request in a tight loop that touches no data. At
concurrency 32 (wrk, one connection per request slot, the set-ups alternating round by round)
it reports each server's requests/s and CPU per request, split by thread: the Python threads
(the event loop running the handler and grpc.aio's completion-queue poller) and the others
(gRPC's own C++ threads, ``event_engine``: sockets and HTTP/2; its timers; uvloop's resolver
pool), from ``/proc/<pid>/task``. If the server's CPU per
request grew by exactly N, handler work would cost what it costs in process; the excess over N
is what the rest of the server spends because the handler got longer. Placing epp between two
spins shows how much of its excess over the no-op any handler of that length would cause.

Usage: ``python -m benchmarks.spin_calibration [--spin 150 --spin 250] [--size 8KB]
[--mode buffered] [--rounds 3] [--duration 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.overhead import (
    SIZES,
    Bench,
    backend_config,
    cpu_seconds,
    pool_config,
    start_setup,
    stat_cpu_seconds,
    wrk,
)
from epp.devstack import Proc, free_port

CONCURRENCY = 32


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread name of process ``pid``, threads of one name
    summed."""
    spent: dict[str, float] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        spent[name] = spent.get(name, 0.0) + stat_cpu_seconds(stat)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spin", type=float, action="append", help="µs; default 150 and 250")
    parser.add_argument("--size", choices=list(SIZES), default="8KB")
    parser.add_argument("--mode", choices=["buffered", "full-duplex"], default="buffered")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4)
    args = parser.parse_args()
    spins = args.spin or [150.0, 250.0]
    workdir = Path(tempfile.mkdtemp(prefix="epp-spin-"))
    bench = Bench(workdir)
    length = SIZES[args.size]
    prompt = ("lorem ipsum dolor sit amet " * (length // 27 + 1))[:length]
    body = workdir / "body.json"
    body.write_text(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}))
    backends = [free_port() for _ in range(3)]
    # set-up -> (server, front port); a spin set-up is the no-op server with --spin-us.
    servers: dict[str, tuple[Proc, int]] = {}
    try:
        admin = free_port()
        bench.envoy("backend", backend_config(backends, admin), admin)
        config_path = workdir / "epp.yaml"
        config_path.write_text(yaml.safe_dump(pool_config(backends)))
        names = ["noop", *(f"spin-{us:g}" for us in spins), "epp"]
        for name in names:
            setup, extra = name, []
            if name.startswith("spin"):
                setup, extra = "noop", ["--spin-us", name.split("-")[1]]
            servers[name] = start_setup(
                bench, setup, args.mode, config_path, sys.executable, body.read_bytes(), extra
            )
        rows: dict[str, list[tuple[float, float, float, float]]] = {}
        for _ in range(args.rounds):
            for name, (server, port) in servers.items():
                url = f"http://127.0.0.1:{port}"
                wrk(url, body, CONCURRENCY, 1, workdir)  # warm-up
                pid = server.popen.pid
                threads, total = thread_cpu(pid), cpu_seconds(pid)
                _, _, rps, _ = wrk(url, body, CONCURRENCY, args.duration, workdir)
                done = rps * args.duration
                after = thread_cpu(pid)
                python = sum(v - threads.get(k, 0.0) for k, v in after.items() if k == "python")
                other = sum(v - threads.get(k, 0.0) for k, v in after.items() if k != "python")
                cpu = cpu_seconds(pid) - total
                rows.setdefault(name, []).append(
                    (rps, cpu / done * 1e6, python / done * 1e6, other / done * 1e6)
                )
                print(f"  {name:10} {rps:6.0f} req/s {cpu / done * 1e6:5.0f} µs/req", flush=True)
    finally:
        for proc in list(bench.procs):
            proc.stop()
    load = " / ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(
        f"\n{args.mode} {args.size}, concurrency {CONCURRENCY}, medians of {args.rounds} rounds "
        f"of {args.duration} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average after {load}\n"
    )
    print(
        "| server | req/s | cpu µs/req | Python threads µs/req | other threads µs/req "
        "| over the no-op µs/req |"
    )
    print("|---|---|---|---|---|---|")
    noop = statistics.median(r[1] for r in rows["noop"])
    for name, runs in rows.items():
        rps, cpu, python, other = (statistics.median(r[i] for r in runs) for i in range(4))
        figures = f"{rps:.0f} | {cpu:.0f} | {python:.0f} | {other:.0f} | {cpu - noop:+.0f}"
        print(f"| {name} | {figures} |")


if __name__ == "__main__":
    main()
