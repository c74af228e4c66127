"""The compose P/D override (docker-compose.pd.yml): valid compose, its references hold, the
sidecar stands in for the simulator's name and fronts the decode replica, may call only the
prefill replica, and epp's configuration finds both by the names compose gives them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from epp.cli import build_parser
from epp.config import load_config
from epp.discovery.spec import DnsSpec
from tests.unit.test_deploy_compose import (
    COMPOSE,
    COMPOSE_DIR,
    REPO,
    USER_ENV,
    cross_reference_problems,
    load,
)

PD_OVERRIDE = REPO / "docker-compose.pd.yml"


def test_the_override_matches_the_compose_spec() -> None:
    tool = Path(sys.executable).parent / "check-jsonschema"
    out = subprocess.run(
        [str(tool), "--builtin-schema", "vendor.compose-spec", str(PD_OVERRIDE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert cross_reference_problems(load(COMPOSE, PD_OVERRIDE), REPO) == []


def test_the_sidecar_fronts_decode_and_epp_finds_both_roles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = load(COMPOSE, PD_OVERRIDE)["services"]
    assert services["sim"]["scale"] == 0
    sidecar = services["pd-sidecar"]
    assert sidecar["networks"]["default"]["aliases"] == ["sim"]
    args = build_parser().parse_args(sidecar["command"])
    assert args.engine == "http://sim-decode:8000"
    assert args.prefill == []
    assert args.prefill_dns == ["sim-prefill:8000"]
    for name in ("sim-prefill", "sim-decode"):
        assert "--kv-connector nixl" in services[name]["entrypoint"][-1]
    monkeypatch.setenv("EPP_REDIS_PASSWORD", USER_ENV["EPP_REDIS_PASSWORD"])
    config = load_config(str(COMPOSE_DIR / "epp-pd.yaml"))
    roles = {
        spec.name: spec.role for spec in config.discovery.values() if isinstance(spec, DnsSpec)
    }
    assert roles == {"sim": "decode", "sim-prefill": "prefill"}
    assert all(name in services for name in roles)
    assert config.scheduling.selected.name == "pd"
    # The mounted configuration is this file.
    (mount,) = services["epp-1"]["volumes"]
    assert mount.startswith("./deploy/compose/epp-pd.yaml:")
