"""Role filters: the decode side takes decode and both (no role is both), the prefill side only
prefill replicas; nothing fits, nothing is kept."""

from __future__ import annotations

from epp.roles import Role
from epp.scheduling.filters.role import RoleFilter
from epp.scheduling.framework import create_plugin
from tests.unit.scheduling.common import cycle, ep, req

ROLES: dict[str, Role] = {"p": "prefill", "d": "decode", "b": "both"}


def kept(plugin_type: str, roles: dict[str, Role], *addresses: str) -> list[str]:
    plugin = create_plugin(plugin_type, plugin_type)
    assert isinstance(plugin, RoleFilter)
    out = plugin.filter(req("x"), [ep(a) for a in addresses], cycle(roles=roles))
    return [c.address for c in out]


def test_decode_filter_keeps_decode_both_and_unlabelled() -> None:
    assert kept("decode-filter", ROLES, "p", "d", "b", "none") == ["d", "b", "none"]


def test_prefill_filter_keeps_only_prefill_replicas() -> None:
    assert kept("prefill-filter", ROLES, "p", "d", "b", "none") == ["p"]


def test_a_fleet_without_roles_is_all_both() -> None:
    assert kept("decode-filter", {}, "a", "b") == ["a", "b"]
    assert kept("prefill-filter", {}, "a", "b") == []


def test_nothing_fitting_keeps_nothing() -> None:
    assert kept("decode-filter", {"p": "prefill"}, "p") == []
