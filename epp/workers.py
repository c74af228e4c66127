"""``epp serve --workers N``: N epp processes on one host, sharing state through Redis.

One Python process routes on one core (the GIL), so a host with more cores runs several. They
must act as one picker: the same prefix index, sessions and in-flight counts, or prefix groups
scatter over replicas and each process piles onto the replica that looks idle to it. The
workers share state exactly as epps on different hosts do (docs/active-active.md): through the
Redis store, which keeps the request path local (every worker routes on its own copies; a
background stream brings the others' picks within a few ms). A shared-memory design would save
the Redis hop but needs a cross-process prefix index, session table and counters with locking
on the hot path, a second implementation of what the Redis store already does for any number of
hosts. So ``--workers`` needs ``store.backend: redis`` (or ``--redis-url``).

Ports: worker ``i`` listens on ext_proc port + 10i, health port + 10i and metrics port + i (the
layout of ``epp dev --epps``), and ``epp envoy-config --workers N`` lists the same addresses as N
endpoints of Envoy's ``epp`` cluster. Not one port shared with SO_REUSEPORT: Envoy multiplexes
ext_proc streams over one HTTP/2 connection per Envoy worker and endpoint, so the kernel would
balance a handful of connections, not the streams.

The parent supervises: a worker that dies is reported and restarted with ``epp dev``'s policy
(:func:`epp.supervisor.supervise`); SIGHUP is passed to every worker (reload); SIGTERM or SIGINT
stop them all gracefully (each drains as a lone ``epp serve`` does).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence

from epp.config import Config
from epp.supervisor import Proc, supervise

PORT_STRIDE = 10
MAX_WORKERS = 64


def worker_ports(
    extproc: int, health: int, metrics: int, workers: int
) -> list[tuple[int, int, int]]:
    """(ext_proc, health, metrics) port of each worker; ValueError if two would coincide."""
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be between 1 and {MAX_WORKERS}, got {workers}")
    ports = [
        (extproc + PORT_STRIDE * i, health + PORT_STRIDE * i, metrics + i) for i in range(workers)
    ]
    flat = [p for triple in ports for p in triple]
    if len(set(flat)) != len(flat) or max(flat) > 65535:
        raise ValueError(
            f"{workers} workers need ext_proc/health ports {extproc}/{health} + {PORT_STRIDE}i "
            f"and metrics ports {metrics} + i, all distinct and below 65536; choose other "
            "server ports"
        )
    return ports


def worker_argv(base: Sequence[str], ports: tuple[int, int, int]) -> list[str]:
    extproc, health, metrics = ports
    return [
        *base,
        *("--port", str(extproc), "--health-port", str(health)),
        *("--metrics-port", str(metrics)),
    ]


def problem(config: Config, workers: int) -> str | None:
    """Why ``config`` cannot run with ``workers`` processes, or None."""
    if workers > 1 and config.store.backend != "redis":
        return (
            f"--workers {workers} needs shared state: set store.backend: redis (or pass "
            "--redis-url); separate in-process stores would each learn a different prefix index"
        )
    return None


def run(config: Config, workers: int, base_argv: Sequence[str]) -> int:
    """Start ``workers`` copies of ``base_argv`` (an ``epp serve`` command without port flags)
    and supervise them until SIGTERM/SIGINT. Returns the exit code."""
    server = config.server
    try:
        ports = worker_ports(server.extproc_port, server.health_port, server.metrics_port, workers)
    except ValueError as exc:
        print(f"epp: {exc}", file=sys.stderr)
        return 2
    procs = [Proc.inherit(f"worker{i}", worker_argv(base_argv, p)) for i, p in enumerate(ports)]
    print(
        f"epp: {workers} workers (pids {', '.join(str(p.popen.pid) for p in procs)}) on ext_proc "
        f"ports {', '.join(str(p[0]) for p in ports)}; `epp envoy-config --workers {workers}` "
        "lists them all",
        file=sys.stderr,
        flush=True,
    )
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    def _reload(*_: object) -> None:
        for proc in procs:
            if proc.alive():
                proc.popen.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGHUP, _reload)
    try:
        while not stopping:
            supervise(procs, lambda message: print(f"epp: {message}", file=sys.stderr, flush=True))
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.stopped = True
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        grace = server.drain_seconds + server.shutdown_grace_seconds + 1
        for proc in procs:
            proc.stop(timeout=grace)
    return 0
