"""``epp serve --workers N`` and ``epp envoy-config --workers N``: the same port layout on both
sides, and shared state required (e2e with Envoy: tests/e2e/test_workers.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from epp.cli import main
from epp.config import parse_config
from epp.envoy_config import add_subcommand, run
from epp.workers import problem, worker_argv, worker_ports

CONFIG = {
    "models": {"tiny": {"pools": ["main"]}},
    "pools": {"main": {"endpoints": ["127.0.0.1:8001"]}},
}


def test_ports_step_by_ten_for_grpc_and_one_for_metrics() -> None:
    assert worker_ports(9002, 9003, 9090, 3) == [
        (9002, 9003, 9090),
        (9012, 9013, 9091),
        (9022, 9023, 9092),
    ]
    assert worker_argv(["epp", "serve"], (9012, 9013, 9091))[-6:] == [
        *("--port", "9012", "--health-port", "9013", "--metrics-port", "9091"),
    ]
    with pytest.raises(ValueError, match="all distinct"):
        worker_ports(9002, 9012, 9090, 2)  # worker 1's ext_proc port is worker 0's health port
    with pytest.raises(ValueError, match="between 1 and"):
        worker_ports(9002, 9003, 9090, 0)


def test_workers_need_the_redis_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert problem(parse_config(CONFIG), 1) is None
    assert "store.backend: redis" in (problem(parse_config(CONFIG), 2) or "")
    shared = {**CONFIG, "store": {"backend": "redis", "redis_url": "redis://127.0.0.1:1/0"}}
    assert problem(parse_config(shared), 2) is None
    path = tmp_path / "epp.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    assert main(["serve", "--config", str(path), "--workers", "2"]) == 2
    assert "needs shared state" in capsys.readouterr().err


def test_envoy_config_lists_every_worker(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    out = tmp_path / "envoy.yaml"
    args = parser.parse_args(["envoy-config", "-c", str(path), "--workers", "3", "-o", str(out)])
    assert run(args) == 0
    (epp,) = [
        c
        for c in yaml.safe_load(out.read_text())["static_resources"]["clusters"]
        if c["name"] == "epp"
    ]
    endpoints = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [
        (
            e["endpoint"]["address"]["socket_address"]["port_value"],
            e["endpoint"]["health_check_config"]["port_value"],
        )
        for e in endpoints
    ] == [(9002, 9003), (9012, 9013), (9022, 9023)]
    two = ["envoy-config", "-c", str(path), "--workers", "2"]
    assert run(parser.parse_args([*two, "--extproc", "a:1", "--extproc", "b:2"])) == 2
