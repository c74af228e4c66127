"""``epp envoy-config``: its flags (the epp addresses, workers, TLS, the EDS directory) and
running it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epp.config import Config, ConfigError, load_config
from epp.discovery.eds import eds_path
from epp.envoy_config.common import MODES, parse_address
from epp.envoy_config.epp_cluster import EppTls
from epp.envoy_config.render import render, seed_eds


def add_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``epp envoy-config`` on the ``epp`` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap that routes through epp",
        description="Render an Envoy 1.40 bootstrap from an epp configuration file.",
    )
    p.add_argument("--config", "-c", required=True, help="epp YAML configuration file")
    p.add_argument("--mode", choices=MODES, default="buffered", help="request body mode")
    p.add_argument("--listen", default="127.0.0.1:8080", help="Envoy listener host:port")
    p.add_argument("--admin", default="127.0.0.1:9901", help="Envoy admin host:port")
    p.add_argument(
        "--extproc",
        action="append",
        metavar="HOST:PORT",
        help="an epp ext_proc address; repeat for several epp processes "
        "(default 127.0.0.1:<server.extproc_port>)",
    )
    p.add_argument(
        "--health",
        action="append",
        metavar="HOST:PORT",
        help="gRPC health address (HOST:PORT or PORT) of each --extproc, in the same order "
        "(default: server.health_port for one epp, ext_proc port + 1 for several)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="epp serve --workers N behind the --extproc address: list its N workers "
        "(ports +10i) as endpoints of the epp cluster",
    )
    p.add_argument("--message-timeout-ms", type=int, default=2000, help="ext_proc message timeout")
    p.add_argument(
        "--eds-dir",
        help="read the pool's endpoints from the EDS file epp serve --eds-dir writes in this "
        "directory (required for Kubernetes pools)",
    )
    p.add_argument(
        "--extproc-ca",
        metavar="FILE",
        help="reach epp over TLS (server.tls), trusting this CA (PEM); needs --extproc-san",
    )
    p.add_argument(
        "--extproc-san",
        metavar="NAME",
        help="the DNS name or IP address epp's certificate must carry (also sent as SNI)",
    )
    p.add_argument(
        "--client-cert",
        metavar="FILE",
        help="Envoy's client certificate for epp's mutual TLS (server.tls.client_ca)",
    )
    p.add_argument("--client-key", metavar="FILE", help="the key of --client-cert")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``epp envoy-config``: 0 on success, 2 on a bad configuration or argument."""
    try:
        config = load_config(args.config)
        extproc = args.extproc or [f"127.0.0.1:{config.server.extproc_port}"]
        health = args.health
        if args.workers != 1:
            extproc, health = _worker_addresses(config, extproc, health, args.workers)
        tls = _tls_args(args)
        text = render(
            config,
            mode=args.mode,
            listen=args.listen,
            admin=args.admin,
            extproc=extproc,
            health=health,
            message_timeout_ms=args.message_timeout_ms,
            eds_dir=args.eds_dir,
            tls=tls,
        )
    except (ConfigError, ValueError) as exc:
        print(f"epp envoy-config: {exc}", file=sys.stderr)
        return 2
    if args.eds_dir and not eds_path(args.eds_dir).exists():
        # Envoy refuses to start without the file; epp serve replaces it once its sources
        # answered. Until then: the static pools' endpoints.
        seed_eds(args.eds_dir, config)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _worker_addresses(
    config: Config, extproc: Sequence[str], health: Sequence[str] | None, workers: int
) -> tuple[list[str], list[str]]:
    """The ext_proc and health addresses of ``epp serve --workers`` (epp/workers.py)."""
    from epp.workers import worker_ports

    if len(extproc) != 1 or (health is not None and len(health) != 1):
        raise ValueError("--workers expands one --extproc (and at most one --health)")
    host, port = parse_address(extproc[0])
    hc_host, hc_port = host, config.server.health_port
    if health:
        hc_host, hc_port = (
            (host, int(health[0])) if health[0].isdigit() else parse_address(health[0])
        )
    ports = worker_ports(port, hc_port, config.server.metrics_port, workers)
    return (
        [f"{_bracket(host)}:{p}" for p, _, _ in ports],
        [f"{_bracket(hc_host)}:{h}" for _, h, _ in ports],
    )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _tls_args(args: argparse.Namespace) -> EppTls | None:
    """The TLS flags as one setting; ValueError names what is missing."""
    if args.extproc_ca is None and args.extproc_san is None:
        if args.client_cert or args.client_key:
            raise ValueError("--client-cert/--client-key need --extproc-ca and --extproc-san")
        return None
    if args.extproc_ca is None or args.extproc_san is None:
        raise ValueError(
            "--extproc-ca and --extproc-san go together (the CA and the name to verify)"
        )
    if (args.client_cert is None) != (args.client_key is None):
        raise ValueError("--client-cert and --client-key go together")
    for path in (args.extproc_ca, args.client_cert, args.client_key):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"no such file: {path} (Envoy reads it at start)")
    # Envoy resolves relative file names against its own working directory, not ours.
    return EppTls(
        _absolute(args.extproc_ca),
        args.extproc_san,
        _absolute(args.client_cert) if args.client_cert else None,
        _absolute(args.client_key) if args.client_key else None,
    )


def _absolute(path: str) -> str:
    return str(Path(path).resolve())
