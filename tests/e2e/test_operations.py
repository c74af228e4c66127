"""Operating epp: config reload, health, and the local stack's start/stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.devstack import Stack, free_port, free_port_run, http_ok
from tests.e2e.client import completion, request
from tests.e2e.conftest import make_stack


def wait_for(check, timeout: float = 5.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def rewrite_config(stack: Stack, change: dict[str, object] | str) -> None:
    text = change if isinstance(change, str) else yaml.safe_dump(change)
    tmp = stack.config_path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, stack.config_path)  # atomic, as editors and config managers do


def test_reload_applies_good_config_keeps_streams_and_refuses_bad(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, "buffered", "memory")
    with stack:
        stack.start()
        epp = stack.procs["epp0"]
        slow_target = stack.replica_addresses[0]
        request(f"http://{slow_target}", "/admin/faults", {"latency_ms": 2500})
        # Streams in flight across both reloads: some land on the slowed replica and are still
        # open (2.5 s) when the config that removes it takes effect.
        results: list[int] = []
        inflight = [
            threading.Thread(
                target=lambda i=i: results.append(completion(stack.url, f"long {i}").status)
            )
            for i in range(6)
        ]
        for t in inflight:
            t.start()
        time.sleep(0.3)

        # 1. A good new config: drop the first replica from the pool.
        config = stack.epp_config()
        config["pools"]["main"]["endpoints"] = stack.replica_addresses[1:]
        rewrite_config(stack, config)
        os.kill(epp.popen.pid, signal.SIGHUP)
        wait_for(lambda: "configuration reloaded" in epp.log.read_text(), what="reload")
        served = Counter(completion(stack.url, f"after reload {i}").served_by for i in range(12))
        assert slow_target not in served
        assert sum(served.values()) == 12

        # 2. A bad config (picked up by the file watch, no signal) is refused; routing goes on.
        rewrite_config(
            stack, "models: {tiny: {pools: [nowhere]}}\npools: {main: {endpoints: []}}\n"
        )
        wait_for(lambda: "reload rejected" in epp.log.read_text(), what="rejection")
        assert "pools.main.endpoints" in epp.log.read_text()
        assert completion(stack.url, "still fine").status == 200

        for t in inflight:
            t.join(30)
        assert results == [200] * 6, "a stream in flight was dropped by the reload"
        request(f"http://{slow_target}", "/admin/faults", {"latency_ms": 0})


def test_grpc_health_services(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, "buffered", "memory")
    with stack:
        stack.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{stack.epp_ports[0][1]}")
        stub = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            assert reply.status == serving, service
        channel.close()


def test_epp_dev_starts_the_stack_and_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    port, admin, base = free_port(), free_port(), free_port_run(3)
    dev = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epp",
            "dev",
            "--port",
            str(port),
            "--admin-port",
            str(admin),
            "--base-port",
            str(base),
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        assert dev.stdout is not None
        for line in dev.stdout:
            lines.append(line)
            if "curl -s" in line:  # the try-it hint printed once everything is ready
                break
        else:
            pytest.fail("epp dev never printed its curl hint:\n" + "".join(lines))
        assert any(line.startswith("ready.") for line in lines)
        reply = completion(f"http://127.0.0.1:{port}", "hello from make run")
        assert reply.status == 200
        children = subprocess.run(
            ["pgrep", "-P", str(dev.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) >= 3  # sims, epp, envoy
        dev.send_signal(signal.SIGINT)
        assert dev.wait(20) == 0
        for pid in children:
            wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), what=f"child {pid} exit")
        assert not http_ok(f"http://127.0.0.1:{admin}/ready")
    finally:
        if dev.poll() is None:
            dev.kill()
