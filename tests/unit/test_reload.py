"""Configuration reloads through the server's real reload path (file on disk, Server.reload).

What plugins learned survives a reload (they are rebuilt, the fleet state is kept); a new scrape
interval is in force everywhere it is used: the scraper's polling, the Redis store's refresh, the
shared-state sync (its lease TTL in Redis) and admission's staleness, so a shorter interval does
not make every endpoint look stale. Restart-only sections are reported once and not applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from epp import errors
from epp.config import SECTIONS, load_config
from epp.prefix.approximate import approx_prefix
from epp.request import InferenceRequest
from epp.scheduling import Cycle
from epp.scheduling.scorers.session import SESSIONS
from epp.scheduling.scorers.ttft import PREFILL_BACKLOG, TtftScorer
from epp.server import Server
from epp.state.shared.connect import hash_tag
from epp.state.shared.keys import Keys
from tests.unit.conftest import SHARED_URL, eventually
from tests.unit.test_sync_scraper import Replica

BASE: dict[str, Any] = {
    "models": {"m": {"pools": ["p"]}},
    "pools": {"p": {"endpoints": ["127.0.0.1:8001"]}},
}
SLOW = 2.0  # seconds between scrapes before the reload
FAST = 0.05


def write(path: Path, replica: Replica, prefix: str, interval: float, **extra: Any) -> None:
    data = {
        "models": {"m": {"pools": ["p"]}},
        "pools": {"p": {"endpoints": [replica.address]}},
        "scrape": {"interval": interval, "timeout": 1.0},
        "store": {"backend": "redis", "redis_url": SHARED_URL, "key_prefix": prefix},
        "request": {"session_header": "x-session"},
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    # A distinct modification time even on coarse clocks: reload() does not depend on it,
    # but the server's own file watch would.
    stamp = time.time() + interval
    os.utime(path, (stamp, stamp))


@pytest.fixture
async def running(tmp_path: Path, prefix: str) -> AsyncIterator[tuple[Server, Replica, Path]]:
    """A server with its state store, shared state and scraper running (not its gRPC ports)."""
    replica = Replica()
    await replica.start()
    path = tmp_path / "epp.yaml"
    write(path, replica, prefix, SLOW)
    server = Server(path, load_config(path))
    assert server.shared is not None
    config = server.router.config
    await server.store.start()
    server.shared.set_endpoints(config.endpoint_pools())
    await server.shared.start()
    server.scraper.set_endpoints(config.endpoint_pools())
    await server.scraper.start()
    try:
        yield server, replica, path
    finally:
        await server.scraper.stop()
        await server.shared.stop()
        await server.store.stop()
        await replica.stop()


def restart_required(section: str) -> float:
    value = REGISTRY.get_sample_value("epp_config_restart_required_total", {"section": section})
    return value or 0.0


def route(server: Server, session: str, priority: int = 0) -> str:
    body = "the same long system prompt " * 100
    request = InferenceRequest(
        "r", "/v1/completions", "completions", "m", body, priority=priority, session=session
    )
    decision, ticket = server.router.route(request)
    server.router.finish(ticket)
    return decision.endpoints[0].address


async def test_reload_keeps_learned_state_and_applies_a_new_scrape_interval(
    running: tuple[Server, Replica, Path], prefix: str
) -> None:
    server, replica, path = running
    address = replica.address
    await eventually(lambda: server.store.snapshot().ready_count() == 1, what="first scrape")
    assert route(server, "s1") == address
    fleet = server.fleet
    learned = (
        fleet.states.get(approx_prefix()).size(address),
        fleet.states.get(SESSIONS).get("s1", time.time()),
    )
    backlog = fleet.states.get(PREFILL_BACKLOG).get(address)
    assert learned[0] > 0
    assert learned[1] == address
    assert backlog is not None

    # An unchanged file: new plugin instances, the same memory.
    old_profile = server.router.generation.profile
    write(path, replica, prefix, SLOW)
    assert await server.reload()
    assert server.router.generation.profile is not old_profile
    assert (
        fleet.states.get(approx_prefix()).size(address),
        fleet.states.get(SESSIONS).get("s1", time.time()),
    ) == learned
    assert fleet.states.get(PREFILL_BACKLOG).get(address) == backlog
    (ttft,) = [s for s, _ in server.router.generation.profile.scorers if isinstance(s, TtftScorer)]
    assert ttft.backlog(address, Cycle(server.store.snapshot(), fleet, now=backlog[1])) > 0
    assert server.scraper.timing[0] == SLOW

    # A shorter interval: in force in the scraper, the store, the shared sync and admission.
    before = replica.scrapes
    write(path, replica, prefix, FAST)
    assert await server.reload()
    assert server.scraper.timing == (FAST, 1.0, 3)
    assert server.store.refresh_interval == FAST  # type: ignore[attr-defined]
    assert server.shared is not None
    assert server.shared.interval == FAST
    assert server.router.config.admission.stale_seconds == max(0.2, 4 * FAST)
    # Ten scrapes would take 20 s at the old interval; the new one does them in about 0.5 s.
    await eventually(lambda: replica.scrapes >= before + 10, within=5.0, what="fast scrapes")
    # Leases are renewed with the new TTL (3 intervals), not the old one's 6 s.
    client = Redis.from_url(SHARED_URL)
    try:
        lease = Keys(hash_tag(prefix)).lease(address)

        async def lease_ttl() -> int:
            return int(await client.pttl(lease))

        deadline = time.monotonic() + 5.0
        while (ttl := await lease_ttl()) > 3 * FAST * 1000:
            assert time.monotonic() < deadline, f"lease TTL still {ttl} ms"
            await asyncio.sleep(FAST / 2)
    finally:
        await client.aclose()
    # Fresh metrics under the new staleness: sheddable requests are served, never 429 (the
    # old scraper interval with the new staleness made every endpoint look stale).
    started = time.monotonic()
    while time.monotonic() - started < 1.0:
        try:
            assert route(server, "s2", priority=-1) == address
        except errors.RequestError as exc:  # pragma: no cover - the failure being tested
            pytest.fail(f"sheddable request refused after the reload: {exc}")
        await asyncio.sleep(0.01)  # requests keep arriving while the scraper runs
    assert fleet.states.get(SESSIONS).get("s1", time.time()) == address


async def test_a_restart_only_change_is_reported_once_and_not_applied(
    running: tuple[Server, Replica, Path], prefix: str
) -> None:
    server, replica, path = running
    port = server.router.config.server.metrics_port
    counted = restart_required("server")
    write(path, replica, prefix, SLOW, server={"metrics_port": port + 1})
    assert await server.reload()
    assert server.router.config.server.metrics_port == port
    assert restart_required("server") == counted + 1
    # The same pending change again (the file touched, a SIGHUP): not reported again.
    write(path, replica, prefix, SLOW, server={"metrics_port": port + 1})
    assert await server.reload()
    assert restart_required("server") == counted + 1
    # A reloadable change in the same file is applied.
    write(path, replica, prefix, FAST, server={"metrics_port": port + 1})
    assert await server.reload()
    assert server.scraper.timing[0] == FAST
    assert restart_required("server") == counted + 1


def test_the_readme_table_matches_the_reload_table_in_code() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (reloadable|restart-only) \|", readme, re.MULTILINE)
    assert dict(rows) == {section: reload.value for section, reload in SECTIONS.items()}


async def test_command_line_overrides_are_not_reported_as_changes(tmp_path: Path) -> None:
    """``epp serve --port`` runs with another port than the file's: reloading the unchanged
    file keeps the override and reports nothing."""
    path = tmp_path / "epp.yaml"
    path.write_text(yaml.safe_dump({**BASE, "server": {"extproc_port": 9100}}))
    loaded = load_config(path)
    running = dataclasses.replace(
        loaded, server=dataclasses.replace(loaded.server, extproc_port=9200)
    )
    server = Server(path, running, loaded=loaded)
    counted = restart_required("server")
    assert await server.reload()
    assert server.router.config.server.extproc_port == 9200
    assert restart_required("server") == counted
