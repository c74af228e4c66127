"""The routers under test, each started in front of its own fresh simulated fleet.

Every router gets a :class:`~epp.devstack.Stack` (the same code that runs ``epp dev`` and the
end-to-end tests): epp profiles use all of it (simulated replicas, epp, Envoy); the baselines
and peers use its simulated replicas and add their own front door, registered in the stack's
process table so one ``stack.stop()`` ends everything.

- ``round-robin`` / ``least-request``: Envoy alone with that cluster ``lb_policy``.
- ``epp-default``, ``gie-default``, ...: epp behind Envoy with the scheduling profile of the same
  name in ``benchmarks/profiles/`` (a file there is a router here).
- ``sglang-router`` / ``vllm-router``: the PyPI routers with ``--policy cache_aware``, installed
  in their own venvs by ``benchmarks/setup_peers.sh``.
"""

from __future__ import annotations

import abc
import json
import math
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from epp.config import ConfigError, parse_config
from epp.devstack import Stack, envoy_binary, free_port, free_port_run, http_ok
from epp.sim.tokenization import BUNDLED_DIR

ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = ROOT / "benchmarks" / "profiles"
PEERS_DIR = ROOT / ".cache" / "peers"
MODEL = "tiny"
# Envoy's default circuit breakers (1024 requests per cluster) would throttle a saturated
# fleet; epp's rendered config lifts them too, so the baselines are configured alike.
_UNLIMITED = {
    "priority": "DEFAULT",
    **dict.fromkeys(
        ("max_connections", "max_pending_requests", "max_requests", "max_retries"), 1_000_000
    ),
}


@dataclass(frozen=True)
class Fleet:
    """The simulated replicas every router is measured on (same for all routers)."""

    replicas: int
    profile: str
    time_scale: float
    block_size: int
    num_gpu_blocks: int
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    sim_processes: int = 1
    # Each replica's compute speed (`epp sim --speed`); empty: all 1.0.
    speeds: tuple[float, ...] = ()
    # Whose /metrics names and KV events the replicas speak (`epp sim --engine`).
    engine: str = "vllm"

    def speed(self, replica: int) -> float:
        return self.speeds[replica] if self.speeds else 1.0

    def sim_args(self) -> list[str]:
        args = [
            "--profile",
            self.profile,
            "--time-scale",
            str(self.time_scale),
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks",
            str(self.num_gpu_blocks),
        ]
        if self.lora_modules:
            args += ["--lora-modules", *(f"{n}=/adapters/{n}" for n in self.lora_modules)]
            args += ["--max-loras", str(self.max_loras)]
        if self.engine != "vllm":
            args += ["--engine", self.engine]
        return args

    @property
    def kv_tokens(self) -> int:
        """Cacheable tokens in the whole fleet (block 0 of each replica is reserved)."""
        return self.replicas * (self.num_gpu_blocks - 1) * self.block_size


@dataclass
class FleetStack(Stack):
    """A :class:`Stack` whose replicas run in several simulator processes.

    One simulator process serves all its replicas on one event loop; a real replica has its
    own CPUs. Splitting the fleet lets the OS spread engine steps, token streaming and
    /metrics rendering (a few ms per scrape, and epp scrapes every replica every 50 ms) over
    the machine's cores instead of queueing them on one.
    """

    sim_processes: int = 1
    # Replica i publishes vLLM KV events on tcp://*:kv_events_base + i (None: no events).
    kv_events_base: int | None = None
    # Replica i computes at speeds[i] (empty: the profile's speed).
    speeds: tuple[float, ...] = ()

    def start_sims(self) -> None:
        assert self.sim_base_port is not None
        per = math.ceil(self.replicas / self.sim_processes)
        for shard, first in enumerate(range(0, self.replicas, per)):
            argv = [
                sys.executable,
                "-m",
                "epp",
                "sim",
                "--replicas",
                str(min(per, self.replicas - first)),
                "--base-port",
                str(self.sim_base_port + first),
                "--model",
                self.model,
                *self.sim_args,
            ]
            if self.kv_events_base is not None:
                argv += ["--kv-events-endpoint", f"tcp://*:{self.kv_events_base + first}"]
            if self.speeds:
                shard_speeds = self.speeds[first : first + per]
                argv += ["--speed", ",".join(f"{v:g}" for v in shard_speeds)]
            self.spawn(f"sim{shard}", argv)


def wait_for(stack: Stack, what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for proc in stack.procs.values():
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited; log {proc.log}:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def completion_ok(url: str, model: str = MODEL) -> bool:
    """One tiny routed request answers 200: the router knows its workers."""
    body = json.dumps({"model": model, "prompt": "ready?", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            status: int = resp.status
            return status == 200
    except OSError:
        return False


class Router(abc.ABC):
    name: str

    def unavailable(self) -> str | None:
        """Why this router cannot run here, or None."""
        return None

    @abc.abstractmethod
    def label(self) -> str:
        """What this router is, for the report."""

    def stack(self, workdir: Path, fleet: Fleet) -> FleetStack:
        return FleetStack(
            workdir,
            replicas=fleet.replicas,
            sim_base_port=free_port_run(fleet.replicas),
            sim_args=fleet.sim_args(),
            model=MODEL,
            sim_processes=fleet.sim_processes,
            speeds=fleet.speeds,
        )

    @abc.abstractmethod
    def start(self, stack: FleetStack, fleet: Fleet, timeout: float) -> str:
        """Start fleet and router; return the front door's URL."""

    def _start_sims(self, stack: FleetStack, timeout: float) -> list[str]:
        stack.workdir.mkdir(parents=True, exist_ok=True)
        stack.start_sims()
        wait_for(
            stack,
            "simulated replicas",
            lambda: all(http_ok(f"http://{a}/health") for a in stack.replica_addresses),
            timeout,
        )
        return [f"http://{a}" for a in stack.replica_addresses]


class EnvoyLB(Router):
    """Envoy alone, balancing over the replicas with a built-in policy: no ext_proc."""

    def __init__(self, name: str, lb_policy: str) -> None:
        self.name = name
        self.lb_policy = lb_policy

    def label(self) -> str:
        return f"Envoy alone, cluster `lb_policy: {self.lb_policy}`"

    def start(self, stack: FleetStack, fleet: Fleet, timeout: float) -> str:
        self._start_sims(stack, timeout)
        listen, admin = free_port(), free_port()
        path = stack.workdir / "envoy.yaml"
        path.write_text(plain_envoy(listen, admin, stack.replica_addresses, self.lb_policy))
        argv = [envoy_binary(), "-c", str(path), "--log-level", "warn"]
        stack.spawn("envoy", [*argv, "--base-id", str(admin), "--concurrency", "1"])
        url = f"http://127.0.0.1:{listen}"
        wait_for(stack, "envoy", lambda: completion_ok(url), timeout)
        return url


def plain_envoy(listen: int, admin: int, replicas: list[str], lb_policy: str) -> str:
    """Front door for the baselines: no route timeout and no circuit-breaker limits, like
    epp's rendered config, so only the balancing policy differs."""

    def sock(address: str, port: int) -> dict[str, Any]:
        return {"socket_address": {"address": address, "port_value": port}}

    hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    route = {"cluster": "pool", "timeout": "0s", "idle_timeout": "0s"}
    endpoints = [{"endpoint": {"address": sock(*_split(a))}} for a in replicas]
    config = {
        "admin": {"address": sock("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "front",
                    "address": sock("127.0.0.1", listen),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": hcm + "HttpConnectionManager",
                                        "stat_prefix": "front",
                                        "stream_idle_timeout": "0s",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {"match": {"prefix": "/"}, "route": route}
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy."
                                                    "extensions.filters.http.router.v3.Router"
                                                },
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "pool",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "lb_policy": lb_policy,
                    "circuit_breakers": {"thresholds": [_UNLIMITED]},
                    "load_assignment": {
                        "cluster_name": "pool",
                        "endpoints": [{"lb_endpoints": endpoints}],
                    },
                }
            ],
        },
    }
    return yaml.safe_dump(config, sort_keys=False)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class EppProfile(Router):
    """epp behind Envoy with a scheduling profile from benchmarks/profiles/NAME.yaml."""

    def __init__(self, profile: str, directory: Path = PROFILES_DIR) -> None:
        self.name = profile
        self.path = directory / f"{profile}.yaml"
        self.spec: dict[str, Any] = (
            yaml.safe_load(self.path.read_text()) if self.path.is_file() else {}
        )

    def label(self) -> str:
        about = self.spec.get("description", "")
        return f"epp behind Envoy, profile `{self.path.relative_to(ROOT)}`: {about}"

    def config_extra(
        self, fleet: Fleet, addresses: list[str], kv_base: int | None
    ) -> dict[str, Any]:
        """The profile's epp settings plus models and pools that fit this fleet."""
        extra: dict[str, Any] = dict(self.spec.get("epp") or {})
        # Adapters use the base model's tokenizer.
        base: dict[str, Any] = {"pools": ["main"]}
        if self.spec.get("tokenizer"):
            base["tokenizer"] = str(BUNDLED_DIR)
        extra["models"] = {MODEL: base} | {n: base | {"lora": True} for n in fleet.lora_modules}
        weighted = bool(self.spec.get("speed_weights")) and bool(fleet.speeds)
        if kv_base is not None or weighted or fleet.engine != "vllm":
            endpoints: list[dict[str, Any]] = []
            for i, address in enumerate(addresses):
                endpoint: dict[str, Any] = {"address": address}
                if kv_base is not None:
                    endpoint["kv_events"] = f"tcp://127.0.0.1:{kv_base + i}"
                if weighted:
                    # Hand-set capacity: the weight a operator would write for this hardware.
                    endpoint["weight"] = fleet.speed(i)
                endpoints.append(endpoint)
            extra["pools"] = {"main": {"endpoints": endpoints, "engine": fleet.engine}}
        return extra

    def unavailable(self) -> str | None:
        if not self.spec:
            return f"no profile file {self.path}"
        fleet = Fleet(1, "h100", 1.0, 16, 2)
        kv_base = 1 if self.spec.get("kv_events") else None
        data = {"pools": {"main": {"endpoints": ["127.0.0.1:1"]}}} | self.config_extra(
            fleet, ["127.0.0.1:1"], kv_base
        )
        try:
            parse_config(data, str(self.path.relative_to(ROOT)))
        except ConfigError as exc:
            return str(exc)
        return None

    def stack(self, workdir: Path, fleet: Fleet) -> FleetStack:
        stack = super().stack(workdir, fleet)
        # EPP_BENCH_LOG_LEVEL=debug logs every pick with each candidate's scores to the
        # stack's epp log (epp.router's "decision" lines): where a stage's slow requests went.
        stack.epp_args = ["--log-level", os.environ.get("EPP_BENCH_LOG_LEVEL", "warning")]
        if self.spec.get("kv_events"):
            taken = {stack.envoy_port, stack.admin_port, *(p for t in stack.epp_ports for p in t)}
            assert stack.sim_base_port is not None
            taken.update(range(stack.sim_base_port, stack.sim_base_port + fleet.replicas))
            stack.kv_events_base = free_port_run(fleet.replicas, taken)
        stack.config_extra = self.config_extra(fleet, stack.replica_addresses, stack.kv_events_base)
        return stack

    def start(self, stack: FleetStack, fleet: Fleet, timeout: float) -> str:
        stack.start(timeout=timeout)
        return stack.url


class Peer(Router):
    """A router from PyPI, run from its own venv under .cache/peers/."""

    def __init__(self, name: str, executable: list[str], extra: list[str]) -> None:
        self.name = name
        self.executable = executable
        self.extra = extra

    def unavailable(self) -> str | None:
        if not Path(self.executable[0]).exists():
            return f"not installed (run: bash benchmarks/setup_peers.sh {self.name})"
        return None

    def label(self) -> str:
        stamps = sorted((PEERS_DIR / self.name).glob(".installed-*"))
        version = stamps[-1].name.removeprefix(".installed-") if stamps else "?"
        return f"{self.name} {version} from PyPI, `--policy cache_aware`, default thresholds"

    def start(self, stack: FleetStack, fleet: Fleet, timeout: float) -> str:
        workers = self._start_sims(stack, timeout)
        port, metrics = free_port(), free_port()
        argv = [
            *self.executable,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            "cache_aware",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics),
            *self.extra,
        ]
        stack.spawn(self.name, argv, {"NO_COLOR": "1"})
        url = f"http://127.0.0.1:{port}"
        wait_for(stack, self.name, lambda: completion_ok(url), timeout)
        return url


def all_routers() -> list[Router]:
    """Baselines, one epp router per profile file, then the peers."""
    sglang = PEERS_DIR / "sglang-router" / "bin"
    vllm = PEERS_DIR / "vllm-router" / "bin"
    return [
        EnvoyLB("round-robin", "ROUND_ROBIN"),
        EnvoyLB("least-request", "LEAST_REQUEST"),
        *(EppProfile(path.stem) for path in sorted(PROFILES_DIR.glob("*.yaml"))),
        Peer(
            "sglang-router",
            [str(sglang / "python"), "-m", "sglang_router.launch_router"],
            ["--shutdown-grace-period-secs", "1", "--log-level", "warn"],
        ),
        Peer("vllm-router", [str(vllm / "vllm-router")], ["--log-level", "warning"]),
    ]


LEARNED_PROFILES = PROFILES_DIR / "learned"


def available(routers: Sequence[Router], unavailable: dict[str, str]) -> list[Router]:
    """The ``routers`` that can run here; each other one is printed and recorded in
    ``unavailable`` with the reason (a peer that is not installed, say)."""
    out = []
    for router in routers:
        why = router.unavailable()
        if why:
            print(f"  {router.name}: unavailable: {why}", flush=True)
            unavailable[router.name] = why
        else:
            out.append(router)
    return out


def named_routers(names: Sequence[str]) -> list[Router]:
    """The routers called ``names``, in that order: :func:`all_routers` plus one epp router per
    profile under ``benchmarks/profiles/learned/`` (benchmark-only variants: candidates and
    former defaults kept for comparisons). Exits naming the unknown ones."""
    known: dict[str, Router] = {r.name: r for r in all_routers()}
    for path in sorted(LEARNED_PROFILES.glob("*.yaml")):
        known.setdefault(path.stem, EppProfile(path.stem, LEARNED_PROFILES))
    missing = [n for n in names if n not in known]
    if missing:
        sys.exit(f"unknown routers: {', '.join(missing)} (known: {', '.join(sorted(known))})")
    return [known[n] for n in names]
