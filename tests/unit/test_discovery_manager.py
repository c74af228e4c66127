"""The discovery manager: sources per pool folded into the configuration the router uses."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from epp.config import Config, parse_config
from epp.discovery import Discovery, DiscoveryOptions, DnsSpec, KubernetesSpec, StaticSpec
from epp.discovery.source import Publish
from epp.discovery.spec import DiscoverySpec, kubernetes_override


class Controlled:
    """A source the test drives: it publishes what the test hands it (static lists at once)."""

    started: list[DiscoverySpec] = []

    def __init__(self, spec: DiscoverySpec) -> None:
        self.spec = spec
        self.publish: Publish | None = None
        Controlled.started.append(spec)
        Controlled.live[spec] = self

    live: dict[DiscoverySpec, Controlled] = {}

    async def run(self, publish: Publish) -> None:
        self.publish = publish
        if isinstance(self.spec, StaticSpec):  # as the real static source does
            publish(frozenset(self.spec.endpoints))
        await asyncio.Event().wait()


def _config(dns_name: str = "sim") -> Config:
    return parse_config(
        {
            "models": {"m": {"pools": ["main", "fixed"]}},
            "pools": {
                "main": {"discovery": {"dns": {"name": dns_name, "port": 8000}}},
                "fixed": {"endpoints": ["10.0.0.9:8000"]},
            },
        }
    )


@pytest.fixture
def changes() -> list[int]:
    Controlled.started.clear()
    Controlled.live.clear()
    return []


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_apply_replaces_discovered_pools_and_keeps_static_ones(changes: list[int]) -> None:
    discovery = Discovery(lambda: changes.append(1), make=Controlled)
    config = _config()
    discovery.configure(config)
    # Before any answer: the discovered pool is empty, the static one routes at once.
    assert discovery.apply(config) == {"main": (), "fixed": ("10.0.0.9:8000",)}
    await _settle()
    assert changes == [1]  # the static list, published at once
    dns = Controlled.live[DnsSpec("sim", 8000)]
    assert dns.publish is not None
    dns.publish(frozenset({"10.0.0.2:8000", "10.0.0.1:8000"}))
    dns.publish(frozenset({"10.0.0.1:8000", "10.0.0.2:8000"}))  # the same set: no change
    assert changes == [1, 1]
    applied = replace(config, pools=discovery.apply(config))
    assert applied.pools["main"] == ("10.0.0.1:8000", "10.0.0.2:8000")  # sorted
    assert applied.endpoints_for_model("m") == (
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.9:8000",
    )
    await discovery.stop()


async def test_reload_keeps_an_unchanged_source_and_restarts_a_changed_one(
    changes: list[int],
) -> None:
    discovery = Discovery(lambda: changes.append(1), make=Controlled)
    discovery.configure(_config())
    await _settle()
    old = Controlled.live[DnsSpec("sim", 8000)]
    assert old.publish is not None
    old.publish(frozenset({"10.0.0.1:8000"}))
    discovery.configure(_config())  # reload, same discovery
    await _settle()
    assert Controlled.started.count(DnsSpec("sim", 8000)) == 1
    assert discovery.apply(_config())["main"] == ("10.0.0.1:8000",)
    discovery.configure(_config("sim2"))  # changed: new source, old one's answers ignored
    await _settle()
    old.publish(frozenset({"10.0.0.7:8000"}))
    assert discovery.apply(_config("sim2"))["main"] == ()
    await discovery.stop()


async def test_eds_file_waits_for_every_source_unless_there_is_none(
    tmp_path: Path, changes: list[int]
) -> None:
    discovery = Discovery(
        lambda: changes.append(1), DiscoveryOptions(eds_dir=str(tmp_path)), make=Controlled
    )
    config = _config()
    discovery.configure(config)
    discovery.export(discovery.apply(config))  # no file yet: written at once (Envoy needs it)
    path = tmp_path / "pool.yaml"
    assert _hosts(path) == {"10.0.0.9:8000"}
    path.write_text(json.dumps({"left": "by a previous epp"}))
    await _settle()
    discovery.export(discovery.apply(config))  # DNS has not answered: file left alone
    assert "previous" in path.read_text()
    dns = Controlled.live[DnsSpec("sim", 8000)]
    assert dns.publish is not None
    dns.publish(frozenset({"[::1]:8000"}))
    discovery.export(discovery.apply(config))
    assert _hosts(path) == {"10.0.0.9:8000", "::1:8000"}
    await discovery.stop()


def _hosts(path: Path) -> set[str]:
    data = json.loads(path.read_text())
    (assignment,) = data["resources"]
    return {
        "{address}:{port_value}".format(**e["endpoint"]["address"]["socket_address"])
        for e in assignment["endpoints"][0]["lb_endpoints"]
    }


def test_pool_name_flag_picks_the_pool() -> None:
    spec = KubernetesSpec("vllm-pool", "prod")
    assert kubernetes_override({"vllm-pool": (), "x": ()}, "vllm-pool", "prod") == {
        "vllm-pool": spec
    }
    assert kubernetes_override({"main": ()}, "vllm-pool", "prod") == {"main": spec}
    with pytest.raises(ValueError, match="several pools"):
        kubernetes_override({"a": (), "b": ()}, "vllm-pool", "prod")


async def test_roles_merge_the_file_dns_and_what_sources_learned(changes: list[int]) -> None:
    config = parse_config(
        {
            "models": {"m": {"pools": ["main", "fixed", "kube"]}},
            "pools": {
                "main": {"discovery": {"dns": {"name": "pre", "port": 8000, "role": "prefill"}}},
                "fixed": {"endpoints": [{"address": "10.0.0.9:8000", "role": "decode"}]},
                "kube": {"discovery": {"kubernetes": {"pool_name": "p"}}},
            },
        }
    )
    assert config.roles == {"10.0.0.9:8000": "decode"}
    discovery = Discovery(lambda: changes.append(1), make=Controlled)
    discovery.configure(config)
    await _settle()
    dns = Controlled.live[DnsSpec("pre", 8000, role="prefill")]
    kube = Controlled.live[KubernetesSpec("p")]
    assert dns.publish is not None
    assert kube.publish is not None
    dns.publish(frozenset({"10.0.0.1:8000"}))
    kube.publish(frozenset({"10.0.1.1:8000", "10.0.1.2:8000"}), {"10.0.1.1:8000": "decode"})
    merged = replace(config, roles=discovery.roles(config))
    assert merged.roles == {
        "10.0.0.9:8000": "decode",
        "10.0.0.1:8000": "prefill",
        "10.0.1.1:8000": "decode",
    }
    # The Pod lost its label: a role learned before never outlives the source's latest word.
    kube.publish(frozenset({"10.0.1.1:8000", "10.0.1.2:8000"}), {})
    assert len(changes) == 4
    assert discovery.roles(merged) == {"10.0.0.9:8000": "decode", "10.0.0.1:8000": "prefill"}
    await discovery.stop()
