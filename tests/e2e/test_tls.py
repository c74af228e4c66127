"""TLS end to end: the real Envoy reaches a real ``epp serve`` over TLS and mutual TLS with the
transport socket ``epp envoy-config --extproc-ca/--extproc-san/--client-cert`` renders, and
clients without the right credentials are refused: plaintext, a certificate from another CA,
a name the certificate does not carry, no client certificate when epp requires one.
Certificates are made here (tests/helpers/certs.py)."""

from __future__ import annotations

import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.config import load_config
from epp.devstack import free_port
from epp.envoy_config import EXTPROC_SERVICE, EppTls, render
from tests.e2e.client import completion
from tests.helpers.certs import Ca, Leaf
from tests.helpers.envoy import EnvoyProcess, wait_for_port

SAN = "epp.test"


@dataclass(frozen=True)
class Pki:
    ca: Ca
    epp: Leaf
    envoy: Leaf
    other_ca: Ca
    other_client: Leaf


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = Ca.create(tmp_path, "fleet")
    other = Ca.create(tmp_path, "other")
    return Pki(
        ca=ca,
        epp=ca.issue("epp", [SAN]),
        envoy=ca.issue("envoy", ["envoy.test"]),
        other_ca=other,
        other_client=other.issue("intruder", ["envoy.test"]),
    )


@dataclass
class Epp:
    config: Path
    extproc: int
    health: int
    metrics: int


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    proc = _spawn(
        [sys.executable, "-m", "epp", "sim", "--port", str(port), "--model", "tiny"],
        tmp_path / "sim.log",
    )
    try:
        wait_for_port(port, timeout=20)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _start_epp(
    tmp_path: Path, sim: int, tls: dict[str, str]
) -> tuple[Epp, subprocess.Popen[bytes]]:
    epp = Epp(tmp_path / "epp.yaml", free_port(), free_port(), free_port())
    epp.config.write_text(
        yaml.safe_dump(
            {
                "models": {"tiny": {"pools": ["main"]}},
                "pools": {"main": {"endpoints": [f"127.0.0.1:{sim}"]}},
                "server": {
                    "host": "127.0.0.1",
                    "extproc_port": epp.extproc,
                    "health_port": epp.health,
                    "metrics_port": epp.metrics,
                    "drain_seconds": 0,
                    "tls": tls,
                },
            }
        )
    )
    proc = _spawn(
        [sys.executable, "-m", "epp", "serve", "--config", str(epp.config)],
        tmp_path / "epp.log",
    )
    try:
        wait_for_port(epp.metrics, timeout=20)
    except TimeoutError:
        proc.kill()
        raise AssertionError((tmp_path / "epp.log").read_text()) from None
    return epp, proc


@pytest.fixture
def mtls_epp(tmp_path: Path, sim: int, pki: Pki) -> Iterator[Epp]:
    tls = {"cert": str(pki.epp.cert), "key": str(pki.epp.key), "client_ca": str(pki.ca.path)}
    epp, proc = _start_epp(tmp_path, sim, tls)
    try:
        yield epp
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _envoy(tmp_path: Path, epp: Epp, tls: EppTls, name: str) -> tuple[EnvoyProcess, str]:
    """A started Envoy reaching ``epp`` with ``tls``, and the base URL of its listener."""
    admin, listen = free_port(), free_port()
    text = render(
        load_config(epp.config),
        listen=f"127.0.0.1:{listen}",
        admin=f"127.0.0.1:{admin}",
        extproc=(f"127.0.0.1:{epp.extproc}",),
        tls=tls,
    )
    return EnvoyProcess.start(text, admin, tmp_path / name), f"http://127.0.0.1:{listen}"


def _epp_health(envoy: EnvoyProcess) -> str:
    """Envoy's view of the epp endpoint: 'healthy', or its health flags."""
    _, text = envoy.admin_get("/clusters")
    for line in text.splitlines():
        if line.startswith("epp::") and "::health_flags::" in line:
            return line.rsplit("::", 1)[1]
    return "unknown"


def _stat(envoy: EnvoyProcess, name: str) -> int:
    """A counter of Envoy's; 0 while it does not exist yet."""
    _, text = envoy.admin_get(f"/stats?filter=^{name}$")
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


def _wait(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _connects(port: int, credentials: grpc.ChannelCredentials | None, name: str = SAN) -> bool:
    """Whether a gRPC channel gets READY (handshake done) rather than TRANSIENT_FAILURE."""
    target = f"127.0.0.1:{port}"
    options = [("grpc.ssl_target_name_override", name)]
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials, options=options)
    )
    settled = threading.Event()
    states: list[grpc.ChannelConnectivity] = []

    def seen(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            states.append(state)
            settled.set()

    channel.subscribe(seen, try_to_connect=True)
    try:
        assert settled.wait(10), f"channel to {target} neither READY nor failed"
        return states[0] == grpc.ChannelConnectivity.READY
    finally:
        channel.unsubscribe(seen)
        channel.close()


def _serving(port: int, credentials: grpc.ChannelCredentials) -> bool:
    with grpc.secure_channel(
        f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", SAN)]
    ) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=EXTPROC_SERVICE), timeout=3
        )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _creds(ca: Path, client: Leaf | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_envoy_routes_through_epp_over_tls(
    tmp_path: Path, sim: int, pki: Pki, mutual: bool
) -> None:
    tls = {"cert": str(pki.epp.cert), "key": str(pki.epp.key)}
    if mutual:
        tls["client_ca"] = str(pki.ca.path)
    epp, proc = _start_epp(tmp_path, sim, tls)
    client = pki.envoy if mutual else None
    try:
        envoy_tls = EppTls(
            str(pki.ca.path),
            SAN,
            str(client.cert) if client else None,
            str(client.key) if client else None,
        )
        envoy, base = _envoy(tmp_path, epp, envoy_tls, "envoy")
        with envoy:
            # The cluster turns healthy only through gRPC health checks over the same TLS.
            _wait(lambda: _epp_health(envoy) == "healthy", 15, "Envoy's health checks over TLS")
            _wait(lambda: completion(base, "warm").status == 200, 15, "a routed request")
            reply = completion(base, "hello over tls")
            assert reply.status == 200, reply.body
            assert reply.served_by == f"127.0.0.1:{sim}"
            assert _stat(envoy, "cluster.epp.ssl.handshake") >= 1

        # /metrics is served over the same TLS: verified https works, plain http does not.
        context = ssl.create_default_context(cafile=str(pki.ca.path))
        context.check_hostname = False  # the certificate names epp.test, we dial 127.0.0.1
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        with urllib.request.urlopen(
            f"https://127.0.0.1:{epp.metrics}/metrics", context=context, timeout=5
        ) as resp:
            assert b"epp_requests_total" in resp.read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{epp.metrics}/metrics", timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_clients_without_the_right_credentials_are_refused(mtls_epp: Epp, pki: Pki) -> None:
    good = _creds(pki.ca.path, pki.envoy)
    # The control: the right CA, a client certificate, the name the certificate carries.
    _wait(lambda: _serving(mtls_epp.health, good), 15, "epp ready over mTLS")
    assert _connects(mtls_epp.extproc, good)
    refused = {
        "plaintext": (None, SAN),
        "server certificate from another CA": (_creds(pki.other_ca.path, pki.envoy), SAN),
        "client certificate from another CA": (_creds(pki.ca.path, pki.other_client), SAN),
        "no client certificate": (_creds(pki.ca.path, None), SAN),
        "a name the certificate lacks": (good, "wrong.test"),
    }
    for what, (credentials, name) in refused.items():
        for port in (mtls_epp.extproc, mtls_epp.health):
            assert not _connects(port, credentials, name), (what, port)


def test_envoy_verifies_the_san(tmp_path: Path, mtls_epp: Epp, pki: Pki) -> None:
    """Rendered with a name epp's certificate does not carry, Envoy refuses the handshake:
    the cluster never turns healthy and requests get the JSON 5xx, not a route."""
    wrong = EppTls(str(pki.ca.path), "not-epp.test", str(pki.envoy.cert), str(pki.envoy.key))
    envoy, base = _envoy(tmp_path, mtls_epp, wrong, "envoy-wrong-san")
    with envoy:
        _wait(
            lambda: _stat(envoy, "cluster.epp.ssl.fail_verify_san") >= 1,
            15,
            "a SAN verification failure",
        )
        assert _epp_health(envoy) != "healthy"
        reply = completion(base, "hello")
        assert reply.status >= 500
        assert reply.json()["error"]["code"] in {
            "endpoint_picker_unavailable",
            "upstream_unavailable",
        }
