"""Private Redis deployments for tests: a server, a Sentinel set-up, a three-master Cluster.

Each starts ``redis-server`` processes on free loopback ports, without persistence, and stops
exactly the processes it started. ``available()`` says whether the binaries exist (skip the test
otherwise). All synchronous; from async tests call them with ``asyncio.to_thread`` if a slow
start would starve the event loop.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from epp.devstack import free_port


def available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"redis on port {port} did not start") from None
            time.sleep(0.01)


def cli(port: int, *args: str) -> str:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), *args], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


class RedisServer:
    """One ``redis-server`` that a test can stop (crash) and start again on the same port."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self._args = args
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                *("redis-server", "--bind", "127.0.0.1", "--port", str(self.port)),
                *("--save", "", "--appendonly", "no", "--dir", str(self.workdir)),
                *self._args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, self._proc)
        return self

    def kill(self) -> None:
        """Stop abruptly (SIGKILL): what a crashed or unplugged Redis looks like."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            self._proc = None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(5)
            self._proc = None


class SentinelSetup:
    """A master, a replica and one Sentinel watching them as service ``mymaster``."""

    service = "mymaster"

    def __init__(self, workdir: Path) -> None:
        self.master = RedisServer(workdir / "master")
        self.replica = RedisServer(
            workdir / "replica", "--replicaof", "127.0.0.1", str(self.master.port)
        )
        self.sentinel_port = free_port()
        self._workdir = workdir
        self._sentinel: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.service}"

    def start(self) -> SentinelSetup:
        self.master.start()
        self.replica.start()
        conf = self._workdir / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 2000\n"
        )
        self._sentinel = subprocess.Popen(
            ["redis-server", str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.sentinel_port, self._sentinel)
        # The Sentinel must have found the replica before it can fail over to it.
        deadline = time.monotonic() + 10
        while "slave" not in cli(self.sentinel_port, "sentinel", "replicas", self.service):
            if time.monotonic() > deadline:
                raise RuntimeError("sentinel never saw the replica")
            time.sleep(0.1)
        return self

    def master_port(self) -> int:
        reply = cli(self.sentinel_port, "sentinel", "get-master-addr-by-name", self.service)
        return int(reply.split()[-1])

    def failover(self, timeout: float = 10.0) -> int:
        """Promote the replica (``SENTINEL FAILOVER``); returns the new master's port."""
        old = self.master_port()
        deadline = time.monotonic() + timeout
        # Refused (NOGOODSLAVE) until the Sentinel has seen the replica's link to the master up.
        while (reply := cli(self.sentinel_port, "sentinel", "failover", self.service)) != "OK":
            if time.monotonic() > deadline:
                raise RuntimeError(f"sentinel refused to fail over: {reply}")
            time.sleep(0.1)
        while (port := self.master_port()) == old:
            if time.monotonic() > deadline:
                raise RuntimeError("sentinel failover did not happen")
            time.sleep(0.05)
        return port

    def stop(self) -> None:
        if self._sentinel is not None:
            self._sentinel.terminate()
            self._sentinel.wait(5)
            self._sentinel = None
        self.replica.stop()
        self.master.stop()


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class ClusterSetup:
    """Three masters, no replicas, all 16384 slots assigned (``redis-cli --cluster create``)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                workdir / f"node{i}",
                *("--cluster-enabled", "yes", "--cluster-node-timeout", "2000"),
                *("--cluster-config-file", "nodes.conf"),
                port=cluster_port(),
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{seeds}"

    def start(self) -> ClusterSetup:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        options = ["--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, *options],
            check=True,
            capture_output=True,
        )
        deadline = time.monotonic() + 10
        port = self.nodes[0].port
        while "cluster_state:ok" not in cli(port, "cluster", "info"):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not become ready")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
