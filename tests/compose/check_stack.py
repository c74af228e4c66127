"""Bring up docker-compose.yml under podman-compose and check it does what docs/deploy.md says.

1. ``up``: Envoy, two epp, Redis, two simulated replicas, Prometheus, the Grafana stand-in.
   Redis authenticates (a random EPP_REDIS_PASSWORD, as docs/deploy.md has users set): a
   client without the password is refused, and both epps share state through it as ``epp``.
2. Requests through Envoy land on the replica epp chose: each response's ``x-served-by`` (the
   replica's own address) equals the first endpoint of epp's decision for that request id
   (``/debug/decisions/<id>`` on whichever epp handled it), and both epps take requests.
3. Prometheus scrapes both epps and every replica (found by DNS, as epp finds them).
4. ``up --scale sim=4``: the two new replicas are served through the same Envoy container
   (same container id and start time: Envoy was not restarted). Until Envoy has resolved a new
   replica (within one DNS interval) a request epp sends there is served from epp's fallback
   list, which the check allows and counts; then 20 requests must all land on epp's choice.
5. One new replica stopped: both epps drop it (it leaves DNS) and it gets no more requests.
6. ``down``, always, also when a step fails.

Before all that, the epp image itself: uid 10001, no compiler, ``epp`` and ``epp sim`` run.
Run by tests/compose/run.sh after the images exist; it prints each step as it goes.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from epp.devstack import free_port

REPO = Path(__file__).resolve().parents[2]
TAG = "compose-test"
IMAGES = {
    "EPP_IMAGE": f"localhost/epp:{TAG}",
    "ENVOY_IMAGE": f"localhost/epp-standin-envoy:{TAG}",
    "REDIS_IMAGE": f"localhost/epp-standin-redis:{TAG}",
    "PROMETHEUS_IMAGE": f"localhost/epp-standin-prometheus:{TAG}",
    "GRAFANA_IMAGE": f"localhost/epp-standin-grafana:{TAG}",
}
EPPS = ("EPP1_METRICS_PORT", "EPP2_METRICS_PORT")
PORTS = (
    "ENVOY_PORT",
    "ENVOY_ADMIN_PORT",
    "EPP1_METRICS_PORT",
    "EPP2_METRICS_PORT",
    "PROMETHEUS_PORT",
    "GRAFANA_PORT",
)
T = TypeVar("T")


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


class StackError(AssertionError):
    pass


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 1.0) -> T:
    """Poll ``probe`` until it returns something truthy; say what is awaited while waiting."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    last_note = started
    while True:
        result = probe()
        if result:
            return result
        now = time.monotonic()
        if now > deadline:
            raise StackError(f"timed out after {timeout:.0f} s waiting for {what}")
        if now - last_note >= 15:
            print(f"    still waiting for {what} ({now - started:.0f} s)", flush=True)
            last_note = now
        time.sleep(every)


# Run inside a simulator container: it listens on the container's address, not loopback.
_READ_HEADERS = (
    "import socket, urllib.request; "
    "ip = socket.gethostbyname(socket.gethostname()); "
    "print(urllib.request.urlopen(f'http://{ip}:8000/admin/headers').read().decode())"
)


def http(
    url: str,
    body: dict[str, object] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()
    except OSError:
        return 0, {}, b""


class Stack:
    def __init__(
        self,
        compose: list[str],
        files: tuple[str, ...] = ("docker-compose.yml",),
        project: str = "epp-compose-test",
    ) -> None:
        self.project = f"{project}-{os.getpid()}"
        self.compose = compose
        self.files = [arg for name in files for arg in ("-f", str(REPO / name))]
        self.ports = {name: free_port() for name in PORTS}
        self.env = {
            **os.environ,
            **IMAGES,
            **{k: str(v) for k, v in self.ports.items()},
            "COMPOSE_PROJECT_NAME": self.project,
            "EPP_REDIS_PASSWORD": secrets.token_hex(16),
        }

    def run(self, *args: str, check: bool = True) -> str:
        argv = [*self.compose, "-p", self.project, *self.files, *args]
        out = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, check=False
        )
        if check and out.returncode != 0:
            raise StackError(
                f"{' '.join(argv)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
            )
        return out.stdout

    def podman(self, *args: str) -> str:
        return subprocess.run(["podman", *args], capture_output=True, text=True, check=True).stdout

    def down(self) -> list[str]:
        """``down``, then remove whatever it left: podman-compose's ``down`` knows only the
        containers the file's ``scale`` gives, not the ones ``--scale`` added. Returns what was
        still there after ``down``."""
        self.run("down", "-t", "3", check=False)
        label = f"label=io.podman.compose.project={self.project}"
        left = subprocess.run(
            ["podman", "ps", "-aq", "--filter", label], capture_output=True, text=True, check=False
        ).stdout.split()
        if left:
            subprocess.run(["podman", "rm", "-f", *left], capture_output=True, check=False)
        network = f"{self.project}_default"
        subprocess.run(["podman", "network", "rm", "-f", network], capture_output=True, check=False)
        return left

    def containers(self, service: str) -> list[str]:
        out = self.podman(
            "ps",
            "-q",
            "--filter",
            f"label=io.podman.compose.project={self.project}",
            "--filter",
            f"label=io.podman.compose.service={service}",
        )
        return out.split()

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def replica_headers(self) -> Counter[str]:
        """Header names the simulated replicas' inference requests arrived with, summed over
        the replicas (each answers GET /admin/headers on its container address)."""
        total: Counter[str] = Counter()
        for container in self.containers("sim"):
            out = self.podman("exec", container, "python", "-c", _READ_HEADERS)
            total.update(json.loads(out))
        return total

    def complete(
        self, request_id: str, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        return http(
            f"{self.url('ENVOY_PORT')}/v1/completions",
            {
                "model": "tiny",
                "prompt": f"Hello from the compose test {request_id}",
                "max_tokens": 4,
            },
            {"x-request-id": request_id, **(headers or {})},
        )

    def stream_with_usage(self, request_id: str) -> int:
        """A streamed completion that asks for usage (the last chunk): where the replica's
        cached prompt tokens reach epp."""
        status, _, _ = http(
            f"{self.url('ENVOY_PORT')}/v1/completions",
            {
                "model": "tiny",
                "prompt": f"Stream from the compose test {request_id}",
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            {"x-request-id": request_id},
        )
        return status

    def learns_from_engine(self) -> list[str]:
        """The replicas whose TTFT some epp learns from the engine's cached-token count."""
        return [
            address
            for epp in EPPS
            for address, state in (self.endpoints(epp) or {}).items()
            if isinstance(state, dict)
            and isinstance(state.get("latency"), dict)
            and state["latency"].get("uncached_from") == "engine"
        ]

    def decision(self, request_id: str) -> tuple[str, list[str]] | None:
        found = self.decided(request_id)
        return None if found is None else (found[0], found[1]["endpoints"])

    def decided(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        """The epp that decided ``request_id`` and its decision record (/debug/decisions)."""
        for epp in EPPS:
            status, _, body = http(f"{self.url(epp)}/debug/decisions/{request_id}")
            if status == 200:
                return epp, json.loads(body)
        return None

    def endpoints(self, epp: str) -> dict[str, object] | None:
        """What ``epp`` shows in /debug/endpoints; None while its admin port does not answer
        (probes poll until their deadline: a published port may refuse connections for a
        moment after the container started, and the first completion may not have gone
        through that epp)."""
        status, _, body = http(f"{self.url(epp)}/debug/endpoints")
        if status != 200:
            return None
        found: dict[str, object] = json.loads(body)
        return found

    def envoy_clusters(self) -> list[str]:
        """Envoy's admin ``/clusters`` text, one ``cluster::host::stat::value`` per line."""
        status, _, body = http(f"{self.url('ENVOY_ADMIN_PORT')}/clusters")
        return body.decode().splitlines() if status == 200 else []

    def envoy_pool(self) -> set[str]:
        """The replicas Envoy's ``pool`` cluster has resolved."""
        return {
            line.split("::")[1]
            for line in self.envoy_clusters()
            if line.startswith("pool::") and line.count("::") >= 2
        }

    def envoy_sees_both_epps(self) -> bool:
        """Both epps pass Envoy's gRPC health checks: until then Envoy may send every stream
        to one of them."""
        healthy = [
            line
            for line in self.envoy_clusters()
            if line.startswith("epp::") and line.endswith("::health_flags::healthy")
        ]
        return len(healthy) == 2

    def agreed(self, count: int) -> bool:
        """Both epps see ``count`` ready replicas and Envoy has resolved every one of them."""
        ready = []
        for epp in EPPS:
            found = self.endpoints(epp)
            if found is None:
                return False
            ready.append({a for a, e in found.items() if isinstance(e, dict) and e.get("ready")})
        return all(len(r) == count for r in ready) and ready[0] == ready[1] <= self.envoy_pool()

    def metric(self, epp: str, name: str) -> float | None:
        """One unlabelled sample of ``epp``'s /metrics, None while it does not answer."""
        status, _, body = http(f"{self.url(epp)}/metrics")
        found = re.search(rf"^{name} (\S+)$", body.decode(), re.MULTILINE)
        return float(found.group(1)) if status == 200 and found else None

    def logs(self) -> str:
        return self.run("logs", "--tail", "30", check=False)


@dataclass
class Routed:
    """Where requests went: per replica, per deciding epp, and how many Envoy served from
    epp's fallback list instead of its first choice."""

    served: Counter[str] = field(default_factory=Counter)
    deciders: Counter[str] = field(default_factory=Counter)
    fallbacks: int = 0


def check_routing(stack: Stack, count: int, fallback_ok: bool = False) -> Routed:
    """Send ``count`` requests; each must land on epp's first choice, or with ``fallback_ok``
    on another endpoint of epp's list: right after a scale-up epp may pick a replica Envoy has
    not resolved yet (each re-resolves the name every interval), and Envoy then serves the
    request from epp's fallback list (docs/discovery.md). Never on a replica epp did not list.
    """
    routed = Routed()
    for _ in range(count):
        request_id = f"compose-{uuid.uuid4().hex[:12]}"
        status, headers, body = stack.complete(request_id)
        if status != 200:
            # Everything that tells who answered: epp (its JSON error), Envoy (its local reply
            # text) or the replica, and what epp and Envoy knew of the pool at that moment.
            raise StackError(
                f"request {request_id} got HTTP {status} through Envoy: {body[:300]!r}; "
                f"headers {headers}; epp decided {stack.decision(request_id)}; "
                f"Envoy's pool {sorted(stack.envoy_pool())}"
            )
        found = stack.decision(request_id)
        if found is None:
            raise StackError(f"neither epp has a decision for {request_id} (debug log on?)")
        epp, endpoints = found
        served_by = headers.get("x-served-by", "")
        if served_by != endpoints[0] and not (fallback_ok and served_by in endpoints):
            raise StackError(f"{request_id}: served by {served_by}, epp chose {endpoints}")
        routed.fallbacks += served_by != endpoints[0]
        routed.served[served_by] += 1
        routed.deciders[epp] += 1
    return routed


def envoy_identity(stack: Stack) -> str:
    (container,) = stack.containers("envoy")
    return stack.podman("inspect", "-f", "{{.Id}} {{.State.StartedAt}}", container).strip()


def prometheus_targets(stack: Stack) -> dict[str, list[str]] | None:
    status, _, body = http(f"{stack.url('PROMETHEUS_PORT')}/api/v1/targets")
    if status != 200:
        return None
    up: dict[str, list[str]] = {}
    for target in json.loads(body)["data"]["activeTargets"]:
        if target["health"] == "up":
            up.setdefault(target["labels"]["job"], []).append(target["labels"]["instance"])
    return up


def check_image() -> None:
    """The epp image as the Dockerfile promises: non-root, no compiler, both commands."""
    image = IMAGES["EPP_IMAGE"]

    def run(*argv: str, entrypoint: str | None = None) -> str:
        cmd = ["podman", "run", "--rm", *(["--entrypoint", entrypoint] if entrypoint else [])]
        return subprocess.run(
            [*cmd, image, *argv], capture_output=True, text=True, check=True
        ).stdout.strip()

    uid = run("-u", entrypoint="id")
    compilers = run("-c", "command -v gcc cc c++ clang || true", entrypoint="sh")
    version = run("--version")
    sim = run("sim", "--help")
    print(f"    uid {uid}; {version}; compilers: {compilers or 'none'}", flush=True)
    if uid == "0" or compilers or not version.startswith("epp ") or "usage: epp sim" not in sim:
        raise StackError(
            f"the epp image is not as the Dockerfile promises: uid {uid}, "
            f"compilers {compilers!r}, version {version!r}"
        )


def main() -> int:
    compose = sys.argv[1:] or ["podman-compose"]
    stack = Stack(compose)
    failed = True
    try:
        step(f"the epp image ({IMAGES['EPP_IMAGE']}): non-root, no compiler, epp and epp sim")
        check_image()
        step(f"podman-compose up (project {stack.project}, Envoy on {stack.url('ENVOY_PORT')})")
        stack.run("up", "-d")
        step("waiting for the first completion through Envoy (epp discovers the replicas by DNS)")
        wait_for("a 200 from /v1/completions", lambda: stack.complete("warm-up")[0] == 200, 180)

        wait_for("both epps and Envoy to know the 2 replicas", lambda: stack.agreed(2), 60, 0.2)
        wait_for("Envoy's health checks to pass on both epps", stack.envoy_sees_both_epps, 30, 0.2)

        step("Redis refuses a client without the password; both epps share state through it")
        (redis,) = stack.containers("redis")
        refused = stack.podman("exec", redis, "redis-cli", "set", "{epp}:stranger", "1").strip()
        if not refused.startswith("NOAUTH"):
            raise StackError(f"Redis let a client without the password in: {refused!r}")
        wait_for(
            "epp_state_store_up 1 and epp_shared_members 2 on both epps",
            lambda: all(
                stack.metric(epp, "epp_state_store_up") == 1
                and stack.metric(epp, "epp_shared_members") == 2
                for epp in EPPS
            ),
            30,
            0.5,
        )
        print(f"    without the password: {refused}; with it: both epps in one group", flush=True)
        step("a client's own priority and tenant are ignored (identity is untrusted by default)")
        forged = {"x-priority": "999999", "x-gateway-inference-fairness-id": "someone-else"}
        status, headers, _ = stack.complete("forged-identity", forged)
        if status != 200:
            raise StackError(f"a request with forged identity headers got {status}")
        decider, record = wait_for(
            "the forged request's decision", lambda: stack.decided("forged-identity"), 10, 0.2
        )
        if record.get("priority") != 0 or any(h.startswith("x-ratelimit") for h in headers):
            raise StackError(f"{decider} honoured a forged identity: {record}")
        seen = stack.replica_headers()
        if not seen["x-request-id"]:  # Envoy forwards it: the count works
            raise StackError(f"the replicas report no x-request-id at all: {dict(seen)}")
        leaked = [h for h in forged if seen[h]]
        if leaked:
            raise StackError(f"a client's {', '.join(leaked)} reached a replica: {dict(seen)}")
        print(
            f"    {decider} decided it at priority {record['priority']}; the replicas saw "
            f"x-request-id {seen['x-request-id']} times, x-priority never",
            flush=True,
        )
        step("requests until both epps have decided one (active-active), each on epp's choice")
        first = Routed()

        def both_epps_decided() -> bool:
            one = check_routing(stack, 1)
            first.served.update(one.served)
            first.deciders.update(one.deciders)
            return len(first.deciders) == 2

        # Round robin starts wherever Envoy's balancer was when the second epp turned healthy:
        # wait for both rather than count.
        wait_for("a request decided by each epp", both_epps_decided, 30, 0.05)
        step("20 requests: each must be served by the replica epp chose")
        more = check_routing(stack, 20)
        first.served.update(more.served)
        first.deciders.update(more.deciders)
        print(f"    served by {dict(first.served)}; decided by {dict(first.deciders)}", flush=True)

        step("streamed completions with usage: epp learns TTFTs from the engine's cached tokens")
        for i in range(4):
            status = stack.stream_with_usage(f"usage-{i}")
            if status != 200:
                raise StackError(f"a streamed completion with usage got HTTP {status}")
        engine = wait_for(
            "an epp showing uncached_from: engine in /debug/endpoints",
            stack.learns_from_engine,
            15,
            0.2,
        )
        print(f"    learned from the engine's count: {sorted(set(engine))}", flush=True)

        step("Prometheus scrapes both epps and every replica")
        replicas = set(first.served)
        targets = wait_for(
            "Prometheus targets epp x2 and vllm x2 up",
            lambda: (
                (t := prometheus_targets(stack))
                and len(t.get("epp", [])) == 2
                and len(t.get("vllm", [])) == 2
                and t
            ),
            90,
        )
        print(f"    up: {targets}", flush=True)

        step(
            "Grafana: a STAND-IN (no Grafana server can be installed here) checks the "
            "provisioning mount only"
        )
        status, _, body = http(f"{stack.url('GRAFANA_PORT')}/datasources/prometheus.yaml")
        if status != 200 or b"http://prometheus:9090" not in body:
            raise StackError(f"Grafana's provisioning is not mounted (HTTP {status})")

        before = envoy_identity(stack)
        step("podman-compose up --scale sim=4 on the running stack")
        stack.run("up", "-d", "--scale", "sim=4")
        if len(stack.containers("sim")) != 4:
            raise StackError(f"expected 4 sim containers, found {stack.containers('sim')}")

        window = Routed()

        def new_replicas_served() -> set[str] | None:
            seen = check_routing(stack, 8, fallback_ok=True)
            window.served.update(seen.served)
            window.fallbacks += seen.fallbacks
            new = set(window.served) - replicas
            return new if len(new) >= 2 else None

        new = wait_for("requests served by the two new replicas", new_replicas_served, 90, 0.5)
        print(
            f"    new replicas serving: {sorted(new)}; {sum(window.served.values())} requests, "
            f"{window.fallbacks} served from epp's fallback list while Envoy had not resolved "
            "the new replica yet",
            flush=True,
        )
        wait_for("both epps and Envoy to know the 4 replicas", lambda: stack.agreed(4), 30, 0.2)
        settled = check_routing(stack, 20)
        print(f"    then 20 requests all on epp's first choice: {dict(settled.served)}", flush=True)
        if envoy_identity(stack) != before:
            raise StackError("Envoy was restarted by the scale-up; it should follow DNS instead")
        print("    Envoy container unchanged (same id and start time)", flush=True)

        gone = sorted(new)[0]
        step(f"stop the replica at {gone}: it leaves DNS, epp's candidates and traffic")
        (container,) = (
            c
            for c in stack.containers("sim")
            if stack.podman(
                "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", c
            ).strip()
            == gone.partition(":")[0]
        )
        stack.podman("stop", "-t", "1", container)
        stopped_at = time.monotonic()
        wait_for(
            f"epp-1 and epp-2 to drop {gone}",
            lambda: all(gone not in (stack.endpoints(epp) or {gone: None}) for epp in EPPS),
            30,
            0.2,
        )
        after = check_routing(stack, 20).served
        if gone in after:
            raise StackError(f"{gone} was stopped but still served {after[gone]} requests")
        print(
            f"    dropped by both epps {time.monotonic() - stopped_at:.1f} s after the stop; "
            f"the next 20 requests all served, by {dict(after)}",
            flush=True,
        )
        failed = False
    except (StackError, subprocess.CalledProcessError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        print(f"last logs of the stack:\n{stack.logs()}", file=sys.stderr)
        print(
            "re-run with the stack kept: EPP_COMPOSE_KEEP=1 make test-compose; then "
            f"podman-compose -p {stack.project} logs",
            file=sys.stderr,
        )
    finally:
        if os.environ.get("EPP_COMPOSE_KEEP") and failed:
            print(
                f"kept project {stack.project} (EPP_COMPOSE_KEEP); remove it with "
                f"podman-compose -p {stack.project} down",
                file=sys.stderr,
            )
        else:
            step("podman-compose down (and whatever --scale added)")
            left = stack.down()
            if left:
                print(f"    removed {len(left)} containers podman-compose down left behind")
    if not failed:
        print("compose stack: OK", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
