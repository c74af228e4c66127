"""The `sim` subcommand contract: arguments, ready lines, clean exit on SIGTERM."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import urllib.request

import pytest

from epp.sim.cli import add_subcommand, build_configs

from .conftest import free_port


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    return parser.parse_args(["sim", *argv])


def test_replicas_get_consecutive_ports_and_event_endpoints() -> None:
    args = parse(
        "--replicas", "3", "--base-port", "9100", "--kv-events-endpoint", "tcp://*:5557",
        "--profile", "cpu-tiny", "--num-gpu-blocks", "100",
    )  # fmt: skip
    configs = build_configs(args)
    assert [c.port for c in configs] == [9100, 9101, 9102]
    assert [c.kv_events_endpoint for c in configs] == [f"tcp://*:{5557 + i}" for i in range(3)]
    assert configs[0].engine.block_size == 32  # the profile's
    assert configs[0].engine.max_model_len == 99 * 32  # capped to what the KV cache holds
    assert not any(c.crash_exits_process for c in configs)
    assert args.func.__name__ == "run"


def test_lora_modules_enable_lora_slots() -> None:
    (config,) = build_configs(parse("--lora-modules", "a=/x", "b=/y", "--max-loras", "2"))
    assert config.lora_modules == {"a": "/x", "b": "/y"}
    assert config.engine.max_loras == 2
    assert config.crash_exits_process


def test_process_prints_ready_serves_and_exits_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp.sim", "--port", str(port), "--time-scale", "0.01"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == f"sim replica 127.0.0.1:{port} ready\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()


def test_speed_is_one_factor_or_one_per_replica() -> None:
    assert [c.engine.speed for c in build_configs(parse("--replicas", "2", "--speed", "3"))] == [
        3.0,
        3.0,
    ]
    configs = build_configs(parse("--replicas", "4", "--speed", "2,2,1,0.5"))
    assert [c.engine.speed for c in configs] == [2.0, 2.0, 1.0, 0.5]
    for bad in ("2,1", "0", "fast"):
        with pytest.raises(SystemExit, match="--speed"):
            build_configs(parse("--replicas", "4", "--speed", bad))
