"""Security settings: server.tls validation, who reads /debug, who sees explain output,
https scraping of a pool (a real aiohttp TLS server), and the rendered Envoy transport socket
(checked by ``envoy --mode validate``). The end-to-end TLS test is tests/e2e/test_tls.py."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from epp.admin import build_app
from epp.config import ConfigError, ServerConfig, load_config, parse_config
from epp.envoy_config import EppTls, bootstrap
from epp.extproc.stream import StreamHandler
from epp.server import Server
from epp.sources.scraper import MetricsScraper
from epp.state import StateStore
from epp.state.memory import MemoryStore
from epp.tls import ClientTls, client_context
from tests.helpers.certs import Ca, Leaf
from tests.helpers.envoy import validate
from tests.unit.conftest import eventually
from tests.unit.test_scraper import PAGE
from tests.unit.test_stream import BODY, body_msg, headers_msg, make_router

BASE: dict[str, Any] = {
    "models": {"tiny": {"pools": ["main"]}},
    "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
}


@pytest.fixture
def ca(tmp_path: Path) -> Ca:
    return Ca.create(tmp_path, "fleet")


@pytest.fixture
def leaf(ca: Ca) -> Leaf:
    return ca.issue("epp", ["epp.test", "127.0.0.1"])


def _errors(**sections: Any) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config({**BASE, **sections})
    return caught.value.errors


# ---------------------------------------------------------------------------- server.tls


def test_server_tls_is_parsed(ca: Ca, leaf: Leaf) -> None:
    tls = {"cert": str(leaf.cert), "key": str(leaf.key), "client_ca": str(ca.path)}
    server = parse_config({**BASE, "server": {"tls": tls}}).server
    assert server.tls is not None
    assert (server.tls.cert, server.tls.key, server.tls.client_ca) == (
        str(leaf.cert),
        str(leaf.key),
        str(ca.path),
    )


def test_server_tls_problems_are_named(tmp_path: Path, ca: Ca, leaf: Leaf) -> None:
    other = ca.issue("other", ["other.test"])
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = {
        "missing": ({"cert": str(tmp_path / "nope.pem"), "key": str(leaf.key)}, "cannot read"),
        "not pem": ({"cert": str(garbage), "key": str(leaf.key)}, "holds no PEM certificate"),
        "mismatch": ({"cert": str(leaf.cert), "key": str(other.key)}, "tls.key: the key"),
        "bad ca": (
            {"cert": str(leaf.cert), "key": str(leaf.key), "client_ca": str(garbage)},
            "server.tls.client_ca: ",
        ),
        "no key": ({"cert": str(leaf.cert)}, "server.tls.key: must be set"),
    }
    for what, (tls, expected) in cases.items():
        (error,) = _errors(server={"tls": tls})
        assert expected in error, (what, error)


def test_pool_metrics_tls_problems(ca: Ca, leaf: Leaf) -> None:
    pool = {"endpoints": ["127.0.0.1:8001"], "metrics_tls": {"ca": str(ca.path)}}
    config = parse_config({**BASE, "pools": {"main": pool}})
    assert config.metrics_tls["main"] == ClientTls(ca=str(ca.path))
    pool["metrics_tls"] = {"cert": str(leaf.cert)}
    (error,) = _errors(pools={"main": pool})
    assert "pools.main.metrics_tls.cert: cert and key must be given together" in error


# ---------------------------------------------------------------------------- /debug access


async def _status(app: web.Application, remote: str, **headers: str) -> int:
    """Status of GET /debug/endpoints from a peer at ``remote`` (the transport's peer name)."""
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (remote, 40000) if name == "peername" else default
    )
    request = make_mocked_request(
        "GET", "/debug/endpoints", headers=headers, app=app, transport=transport
    )
    match = await app.router.resolve(request)
    match.add_app(app)
    request._match_info = match
    response = await app._handle(request)
    return response.status


def test_debug_access_and_the_buffered_budget_are_checked() -> None:
    server = parse_config({**BASE, "server": {"debug_access": "loopback"}}).server
    assert (server.debug_access, server.max_buffered_bytes) == ("loopback", 256 * 1024 * 1024)
    (error,) = _errors(server={"debug_access": "mesh"})
    assert "server.debug_access: must be one of local, loopback, any, got 'mesh'" in error
    (error,) = _errors(server={"max_buffered_bytes": -1})
    assert "server.max_buffered_bytes" in error


async def test_debug_answers_loopback_without_a_token_and_token_holders_with_one() -> None:
    router = await make_router()
    local = build_app(router, ServerConfig())
    local.freeze()
    assert await _status(local, "127.0.0.1") == 200
    assert await _status(local, "::1") == 200
    assert await _status(local, "::ffff:127.0.0.1") == 200
    assert await _status(local, "10.1.2.3") == 403
    # With a token, loopback proves nothing (a mesh sidecar forwards from 127.0.0.6): every
    # caller must send it.
    guarded = build_app(router, ServerConfig(debug_token="s3cret"))
    guarded.freeze()
    assert await _status(guarded, "127.0.0.1") == 403
    assert await _status(guarded, "127.0.0.6") == 403
    assert await _status(guarded, "::1", Authorization="Bearer wrong") == 403
    assert await _status(guarded, "127.0.0.1", Authorization="Bearer s3cret") == 200
    assert await _status(guarded, "10.1.2.3") == 403
    assert await _status(guarded, "10.1.2.3", Authorization="Bearer wrong") == 403
    assert await _status(guarded, "10.1.2.3", Authorization="Bearer s3cret") == 200
    # The explicit development mode: loopback without the token, others with it.
    dev = build_app(router, ServerConfig(debug_access="loopback", debug_token="s3cret"))
    dev.freeze()
    assert await _status(dev, "127.0.0.1") == 200
    assert await _status(dev, "10.1.2.3") == 403
    assert await _status(dev, "10.1.2.3", Authorization="Bearer s3cret") == 200
    opened = build_app(router, ServerConfig(debug_access="any"))
    opened.freeze()
    assert await _status(opened, "10.1.2.3") == 200
    # /metrics stays open to Prometheus wherever it runs.
    async with TestClient(TestServer(guarded)) as client:
        assert (await client.get("/metrics")).status == 200


def test_the_compose_stack_shows_scores_and_debug_to_this_host_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shipped compose configuration sends no scores to clients (Envoy's port is
    published on every interface), and opens /debug only on ports published on loopback."""
    root = Path(__file__).resolve().parents[2]
    # The compose stack reads Redis' password from the environment (docs/deploy.md).
    monkeypatch.setenv("EPP_REDIS_PASSWORD", "0123456789abcdef")
    config = load_config(root / "deploy/compose/epp.yaml")
    routing, server = config.routing, config.server
    assert not routing.explains_to(None, server.debug_token)
    if server.debug_access == "any":
        compose = yaml.safe_load((root / "docker-compose.yml").read_text())
        epps = [s for name, s in compose["services"].items() if name.startswith("epp")]
        assert epps
        for service in epps:
            for port in service.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), port


# ---------------------------------------------------------------------------- explain output


async def _scores(
    routing: dict[str, Any], server: dict[str, Any] | None = None, **headers: str
) -> tuple[bool, list[str]]:
    """(scores in the answer's metadata, headers epp removes) for one request."""
    router = await make_router()
    router.config = parse_config({**BASE, "routing": routing, "server": server or {}})
    handler = StreamHandler(router)
    handler.handle(headers_msg(extra=headers))
    (answer,) = handler.handle(body_msg(BODY))
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    removed = list(answer.request_body.response.header_mutation.remove_headers)
    return "x-epp-scores" in lb, removed


async def test_explain_output_only_for_token_holders() -> None:
    token = {"explain": True, "explain_token": "t0k"}
    assert await _scores(token) == (False, [])
    assert await _scores(token, **{"x-epp-explain": "nope"}) == (False, ["x-epp-explain"])
    assert await _scores(token, **{"x-epp-explain": "t0k"}) == (True, ["x-epp-explain"])
    # Without a token every caller sees them (a development setting); without explain nobody.
    assert (await _scores({"explain": True}))[0]
    # server.debug_token guards them too when routing has no token of its own.
    debug = {"server": {"debug_token": "d3bug"}}
    assert not (await _scores({"explain": True}, **debug))[0]
    assert (await _scores({"explain": True}, **debug, **{"x-epp-explain": "d3bug"}))[0]
    assert not (await _scores({"explain": False}, **{"x-epp-explain": "t0k"}))[0]


# ---------------------------------------------------------------------------- https scraping


@pytest.fixture
async def https_metrics(leaf: Leaf) -> AsyncIterator[str]:
    """A vLLM-like /metrics page served over TLS with ``leaf``; yields its address."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    server_ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ssl.load_cert_chain(leaf.cert, leaf.key)
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ssl).start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_scraper_reads_a_pool_over_https(ca: Ca, https_metrics: str, tmp_path: Path) -> None:
    address = https_metrics
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.05, timeout=1.0)
    try:
        # Plain http to a TLS port fails; the pool's CA over https succeeds, also when the
        # certificate is checked for a DNS name instead of the IP.
        scraper.set_endpoints({address: "main"})
        await scraper.start()
        await eventually(lambda: _failures(store, address) >= 1, what="a failed http scrape")
        assert not store.snapshot().endpoints[address].ready
        scraper.set_tls({"main": (client_context(ClientTls(ca=str(ca.path))), None)})
        await eventually(lambda: store.snapshot().endpoints[address].ready, what="https scrape")
        wrong = Ca.create(tmp_path, "wrong")
        scraper.set_tls({"main": (client_context(ClientTls(ca=str(wrong.path))), None)})
        await eventually(lambda: _failures(store, address) >= 1, what="an untrusted server")
        named = client_context(ClientTls(ca=str(ca.path)))
        scraper.set_tls({"main": (named, "epp.test")})
        await eventually(lambda: _failures(store, address) == 0, what="a scrape verified by name")
    finally:
        await scraper.stop()


async def test_a_reload_turns_https_scraping_on(ca: Ca, https_metrics: str, tmp_path: Path) -> None:
    """pools.P.metrics_tls is reloadable: the server hands the scraper the new contexts."""
    path = tmp_path / "epp.yaml"
    pool: dict[str, Any] = {"endpoints": [https_metrics]}
    path.write_text(json.dumps({**BASE, "pools": {"main": pool}}))
    server = Server(path, load_config(path))
    server.scraper.set_endpoints({https_metrics: "main"})
    await server.scraper.start()
    try:
        await eventually(lambda: _failures(server.store, https_metrics) >= 1, what="http fails")
        pool["metrics_tls"] = {"ca": str(ca.path), "server_name": "epp.test"}
        path.write_text(json.dumps({**BASE, "pools": {"main": pool}}))
        assert await server.reload()
        await eventually(
            lambda: server.store.snapshot().endpoints[https_metrics].ready, what="https scrape"
        )
    finally:
        await server.scraper.stop()


def _failures(store: StateStore, address: str) -> int:
    state = store.snapshot().get(address)
    return 0 if state is None else state.failures


# ---------------------------------------------------------------------------- envoy-config


def test_rendered_transport_socket_validates(tmp_path: Path, ca: Ca, leaf: Leaf) -> None:
    config = parse_config(BASE)
    tls = EppTls(str(ca.path), "epp.test", str(leaf.cert), str(leaf.key))
    boot = bootstrap(config, tls=tls)
    (epp,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "epp"]
    context = epp["transport_socket"]["typed_config"]
    assert context["sni"] == "epp.test"
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "epp.test"}}
    ]
    assert common["tls_certificates"][0]["private_key"] == {"filename": str(leaf.key)}
    ip = bootstrap(config, tls=EppTls(str(ca.path), "10.0.0.7"))["static_resources"]
    (ip_epp,) = [c for c in ip["clusters"] if c["name"] == "epp"]
    ip_common = ip_epp["transport_socket"]["typed_config"]["common_tls_context"]
    assert ip_common["validation_context"]["match_typed_subject_alt_names"][0]["san_type"] == (
        "IP_ADDRESS"
    )
    assert "tls_certificates" not in ip_common
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(boot))
    result = validate(path)
    assert result.returncode == 0, result.stdout


def test_envoy_config_tls_flags(tmp_path: Path, ca: Ca, leaf: Leaf, capsys: Any) -> None:
    from epp.cli import main

    config = tmp_path / "epp.yaml"
    config.write_text(json.dumps(BASE))
    argv = ["envoy-config", "-c", str(config), "--extproc-ca", str(ca.path)]
    assert main(argv) == 2
    assert "--extproc-ca and --extproc-san go together" in capsys.readouterr().err
    assert main([*argv, "--extproc-san", "epp.test", "--client-cert", str(leaf.cert)]) == 2
    assert "--client-cert and --client-key go together" in capsys.readouterr().err
    full = [*argv, "--extproc-san", "epp.test"]
    full += ["--client-cert", str(leaf.cert), "--client-key", str(leaf.key)]
    assert main(full) == 0
    assert "UpstreamTlsContext" in capsys.readouterr().out
