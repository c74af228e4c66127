"""TLS material for epp's listeners and for its own connections to the model servers.

Configuration holds file paths only (:class:`ServerTls`, :class:`ClientTls`); this module checks
them up front, with the same loader the servers use later, so a certificate that does not parse
or a key that belongs to another certificate is a configuration error at start (and on reload),
never a listener that fails to come up. Python's ``ssl`` module does the parsing: no extra
dependency, and exactly what aiohttp uses at run time; gRPC is handed the same PEM bytes.

docs/security.md explains what is encrypted and how to generate the files.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class ServerTls:
    """``server.tls``: epp's certificate and key; with ``client_ca`` every client must present
    a certificate signed by it (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None


@dataclass(frozen=True, slots=True)
class ClientTls:
    """``pools.P.metrics_tls``: scrape over https, trusting ``ca`` (default: the system's
    roots), presenting ``cert``/``key`` when the server asks for one, verifying the server's
    certificate for ``server_name`` (default: the endpoint's IP address)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


def _read(path: str, what: str) -> tuple[bytes | None, str | None]:
    try:
        return Path(path).read_bytes(), None
    except OSError as exc:
        return None, f"cannot read the {what} file {path!r}: {exc.strerror}"


def _chain_problem(cert: str, key: str) -> tuple[str, str] | None:
    """None if ``cert`` holds a PEM certificate and ``key`` the PEM private key that matches
    it; else the setting at fault (``cert`` or ``key``) and what is wrong."""
    files = (("cert", cert, "certificate", b"CERTIFICATE-----"), ("key", key, "key", b"KEY-----"))
    for setting, path, what, marker in files:
        data, problem = _read(path, what)
        if problem is not None:
            return setting, problem
        if data is not None and marker not in data:
            expected = f"a '-----BEGIN ...{marker.decode()}' block"
            return setting, f"{path!r} holds no PEM {what} (expected {expected})"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            return "key", f"the key {key!r} does not belong to the certificate {cert!r}"
        return "cert", f"cannot load {cert!r} with {key!r}: {exc.reason or exc}"
    return None


def _ca_problem(path: str, what: str) -> str | None:
    data, problem = _read(path, what)
    if problem is not None:
        return problem
    try:
        ssl.create_default_context(cadata=(data or b"").decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        return f"{path!r} holds no PEM CA certificate: {exc}"
    return None


def server_tls_problems(tls: ServerTls) -> list[tuple[str, str]]:
    """(key, message) for each problem of a ``server.tls`` section."""
    problems = []
    chain = _chain_problem(tls.cert, tls.key)
    if chain is not None:
        problems.append(chain)
    if tls.client_ca is not None:
        ca = _ca_problem(tls.client_ca, "client CA")
        if ca is not None:
            problems.append(("client_ca", ca))
    return problems


def client_tls_problems(tls: ClientTls) -> list[tuple[str, str]]:
    """(key, message) for each problem of a ``metrics_tls`` section."""
    problems = []
    if tls.ca is not None:
        ca = _ca_problem(tls.ca, "CA")
        if ca is not None:
            problems.append(("ca", ca))
    if (tls.cert is None) != (tls.key is None):
        problems.append(("cert", "cert and key must be given together (a client certificate)"))
    elif tls.cert is not None and tls.key is not None:
        chain = _chain_problem(tls.cert, tls.key)
        if chain is not None:
            problems.append(chain)
    return problems


def grpc_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """Credentials for the ext_proc and health servers; with a client CA, a client without a
    certificate it signed is refused during the handshake."""
    ca = Path(tls.client_ca).read_bytes() if tls.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key).read_bytes(), Path(tls.cert).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """The admin (metrics) listener's context, with the same rules as the gRPC servers."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca is not None:
        context.load_verify_locations(tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: ClientTls) -> ssl.SSLContext:
    """Context for scraping one pool: the replica's certificate must chain to ``ca`` and name
    the endpoint's IP address (or ``server_name``)."""
    context = ssl.create_default_context(cafile=tls.ca)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return context
