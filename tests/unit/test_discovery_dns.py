"""DNS discovery against a real DNS server on loopback whose answers change under it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from epp.config import ConfigError, parse_config
from epp.discovery.dns import DnsSource
from epp.discovery.spec import DnsSpec
from tests.helpers.dns_server import DnsServer

INTERVAL = 0.2


class Recorder:
    """Collects published sets; ``wait_for`` waits until ``expected`` is the latest."""

    def __init__(self) -> None:
        self.sets: list[frozenset[str]] = []
        self._changed = asyncio.Event()

    def __call__(self, members: frozenset[str]) -> None:
        self.sets.append(members)
        self._changed.set()

    async def wait_for(self, expected: set[str], within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while not self.sets or self.sets[-1] != expected:
                self._changed.clear()
                await self._changed.wait()


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


async def test_follows_added_and_removed_addresses_at_the_next_lookup(
    dns_server: DnsServer,
) -> None:
    dns_server.set("sim.test", ["127.0.0.2", "127.0.0.3"])
    source = DnsSource(DnsSpec("sim.test", 8000, INTERVAL, ("127.0.0.1", dns_server.port)))
    seen = Recorder()
    task = asyncio.create_task(source.run(seen))
    try:
        await seen.wait_for({"127.0.0.2:8000", "127.0.0.3:8000"})
        steps = [
            ["127.0.0.2", "127.0.0.3", "127.0.0.4"],  # scaled up
            ["127.0.0.4"],  # two gone
            ["127.0.0.4", "::1"],  # AAAA records count too
        ]
        # Counted in lookups (two questions each, A then AAAA), not timed: a busy machine
        # stretches the interval. The question of a lookup in flight at the change, one whole
        # lookup after it, and the first question of the next, which is asked only once that
        # whole lookup has been published.
        for ips in steps:
            asked = dns_server.queries["sim.test"]
            dns_server.set("sim.test", ips)
            await questions_reach(dns_server, asked + 4)
            expected = {f"[{ip}]:8000" if ":" in ip else f"{ip}:8000" for ip in ips}
            assert seen.sets[-1] == expected
        # Scaled to zero: the name disappears (NXDOMAIN), believed at the second lookup.
        asked = dns_server.queries["sim.test"]
        dns_server.set("sim.test", [])
        await questions_reach(dns_server, asked + 6)
        assert seen.sets[-1] == set()
    finally:
        task.cancel()
    # Only changes are published, never the same set twice in a row.
    assert all(a != b for a, b in zip(seen.sets, seen.sets[1:], strict=False))


async def questions_reach(server: DnsServer, count: int) -> None:
    for _ in range(100):
        if server.queries["sim.test"] >= count:
            return
        await asyncio.sleep(INTERVAL / 4)
    raise AssertionError(f"{server.queries['sim.test']} questions about sim.test, not {count}")


async def test_one_answer_without_addresses_keeps_the_pool(dns_server: DnsServer) -> None:
    """A name that vanishes for one lookup (a container runtime's DNS falling through to the
    host's resolver while it reloads) leaves the pool as it was; a second one in a row empties
    it."""
    dns_server.set("sim.test", ["127.0.0.2", "127.0.0.3"])
    source = DnsSource(DnsSpec("sim.test", 8000, INTERVAL, ("127.0.0.1", dns_server.port)))
    seen = Recorder()
    task = asyncio.create_task(source.run(seen))
    try:
        both = {"127.0.0.2:8000", "127.0.0.3:8000"}
        await seen.wait_for(both)
        for blanked in (2, 4):  # one lookup (A and AAAA questions) without addresses, then two
            asked = dns_server.queries["sim.test"]
            dns_server.blank("sim.test", blanked)
            # The blanked lookups have been answered, and the good lookup after them too (the
            # questions of a second one were asked once its answers had been handled).
            await questions_reach(dns_server, asked + blanked + 3)
            if blanked == 2:
                assert seen.sets == [frozenset(both)]
        # The two blank lookups in a row emptied the pool; the good one after refilled it.
        await seen.wait_for(both)
        assert seen.sets == [frozenset(both), frozenset(), frozenset(both)]
    finally:
        task.cancel()


async def test_unreachable_resolver_keeps_the_last_set(dns_server: DnsServer) -> None:
    dns_server.set("sim.test", ["127.0.0.2"])
    source = DnsSource(DnsSpec("sim.test", 8000, INTERVAL, ("127.0.0.1", dns_server.port)))
    seen = Recorder()
    task = asyncio.create_task(source.run(seen))
    try:
        await seen.wait_for({"127.0.0.2:8000"})
        dns_server.__exit__(None, None, None)  # the resolver goes away
        await asyncio.sleep(3 * INTERVAL + 0.5)  # several failed lookups (each times out)
        assert seen.sets == [frozenset({"127.0.0.2:8000"})]
    finally:
        task.cancel()


async def test_system_resolver_reads_hosts_file() -> None:
    # No resolver option: getaddrinfo, which answers "localhost" from /etc/hosts.
    ips = await DnsSource(DnsSpec("localhost", 8000)).resolve()
    assert "127.0.0.1" in ips


def test_config_accepts_the_agreed_shape() -> None:
    config = parse_config(
        {
            "models": {"m": {"pools": ["main", "gpu"]}},
            "pools": {
                "main": {"discovery": {"dns": {"name": "sim", "port": 8000, "interval": 1.0}}},
                "gpu": {
                    "discovery": {"kubernetes": {"pool_name": "vllm-pool", "namespace": "default"}}
                },
            },
        }
    )
    assert config.pools == {"main": (), "gpu": ()}
    assert config.discovery["main"] == DnsSpec("sim", 8000, 1.0)
    assert parse_discovery({"dns": {"name": "sim", "port": 80, "resolver": "127.0.0.1:5353"}}) == (
        DnsSpec("sim", 80, 1.0, ("127.0.0.1", 5353))
    )
    assert parse_discovery({"dns": {"name": "sim", "port": 80, "role": "prefill-decode"}}) == (
        DnsSpec("sim", 80, 1.0, role="both")
    )


def parse_discovery(discovery: dict[str, object]) -> object:
    """The spec a pool's ``discovery`` mapping gives."""
    config = parse_config(
        {"models": {"m": {"pools": ["p"]}}, "pools": {"p": {"discovery": discovery}}}
    )
    return config.discovery["p"]


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            {"endpoints": ["127.0.0.1:1"], "discovery": {"dns": {"name": "a", "port": 1}}},
            "pools.main: must give either endpoints or discovery",
        ),
        ({"discovery": {}}, "pools.main.discovery: must name exactly one source"),
        ({"discovery": {"dns": {"name": "a"}}}, "dns.port: must be set"),
        ({"discovery": {"dns": {"name": "a", "port": 1, "interval": 0}}}, "dns.interval"),
        ({"discovery": {"dns": {"name": "a", "port": 1, "resolver": "x"}}}, "dns.resolver"),
        (
            {"discovery": {"dns": {"name": "a", "port": 1, "ttl": 3}}},
            "dns.ttl: must be one of the known keys",
        ),
        ({"discovery": {"dns": {"name": "a", "port": 1, "role": "x"}}}, "dns.role: must be one"),
        (
            {"endpoints": [{"address": "127.0.0.1:1", "role": "prefil"}]},
            r"pools.main.endpoints\[0\].role: must be one of prefill, decode, both",
        ),
        ({"discovery": {"kubernetes": {"pool_name": "Bad_Name"}}}, "kubernetes.pool_name"),
        (
            {"discovery": {"dns": {"name": "a", "port": 1}, "kubernetes": {"pool_name": "p"}}},
            "exactly one source",
        ),
    ],
)
def test_config_errors_name_the_key(pool: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"models": {"m": {"pools": ["main"]}}, "pools": {"main": pool}})
