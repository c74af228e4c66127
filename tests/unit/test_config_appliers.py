"""Every reloadable configuration key has what applies it on a reload."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.config import SECTIONS, File, Reload, parse_config
from epp.config.appliers import Appliers
from epp.config.file import reloadable_keys
from epp.config.schema import policies
from epp.server import Server

BASE = {
    "models": {"m": {"pools": ["main"]}},
    "pools": {"main": {"endpoints": ["127.0.0.1:8001"]}},
}


def test_every_reloadable_key_of_the_server_has_an_applier(tmp_path: Path) -> None:
    (tmp_path / "epp.yaml").write_text("")
    server = Server(tmp_path / "epp.yaml", parse_config(BASE))
    assert server.appliers.missing() == []
    assert "scrape.interval" in reloadable_keys()
    assert "server.host" not in reloadable_keys()


def test_a_reloadable_key_without_an_applier_is_found() -> None:
    appliers = Appliers()
    applied: list[object] = []
    appliers.register(applied.append, ["scrape", "pools.*.endpoints"])
    missing = appliers.missing()
    assert "scrape.interval" not in missing
    assert "pools.*.endpoints" not in missing
    assert "pools.*.engine" in missing
    assert "health.enabled" in missing
    assert not any(key.startswith(("server", "store", "tracing")) for key in missing)
    config = parse_config(BASE)
    appliers.register(applied.append, ["health"])  # one callable, registered twice: run once
    appliers.apply(config)
    assert applied == [config]
    with pytest.raises(KeyError):
        appliers.register(applied.append, ["helth"])


def test_a_restart_only_key_lies_in_a_restart_only_section() -> None:
    """The server keeps restart-only values section by section (``_keep_restart_only``): a
    restart-only key inside a reloadable section would be applied anyway."""
    keys = policies(File, Reload.APPLIED)
    restart = [key for key, policy in keys.items() if policy is Reload.RESTART]
    assert {key.split(".")[0] for key in restart} == {"server", "store", "tracing"}
    assert all(SECTIONS[key.split(".")[0]] is Reload.RESTART for key in restart)
