"""The ``epp`` command: ``serve``, ``check-config``, ``sim``, ``envoy-config``, ``dev``,
``pd-sidecar``."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from epp import __version__
from epp.config import Config, ConfigError, load_config, server_problems
from epp.config_advice import advice
from epp.discovery import DiscoveryOptions
from epp.discovery.spec import kubernetes_override
from epp.observability import setup_logging
from epp.secrets import SecretError, read_file
from epp.state.shared.connect import has_password

# The Redis URL without a command-line flag: it may carry a password, which a flag would show
# to every user of the machine (ps) and the container runtime.
REDIS_URL_ENV = "EPP_REDIS_URL"


def _redis_url(args: argparse.Namespace) -> str | None:
    """``--redis-url``, the file ``--redis-url-file`` names, or $EPP_REDIS_URL, in that order."""
    if args.redis_url:
        if has_password(args.redis_url):
            print(
                "epp: warning: --redis-url carries a password, which the process list shows; "
                f"use --redis-url-file or ${REDIS_URL_ENV}, or store.redis_password_file",
                file=sys.stderr,
            )
        return str(args.redis_url)
    if args.redis_url_file:
        return read_file(args.redis_url_file)
    return os.environ.get(REDIS_URL_ENV) or None


def _serve(args: argparse.Namespace) -> int:
    from epp.server import serve

    try:
        loaded = load_config(args.config)
    except ConfigError as exc:
        for error in exc.errors:
            print(f"epp: invalid configuration: {error}", file=sys.stderr)
        print("epp: fix the keys named above and start again.", file=sys.stderr)
        return 2
    config = loaded
    try:
        redis_url = _redis_url(args)
    except SecretError as exc:
        print(f"epp: --redis-url-file: {exc}", file=sys.stderr)
        return 2
    if redis_url:
        config = replace(config, store=config.store.with_url(redis_url))
    server = config.server
    overrides = {
        k: v
        for k, v in (
            ("host", args.host),
            ("extproc_port", args.port),
            ("health_port", args.health_port),
            ("metrics_port", args.metrics_port),
            ("log_level", args.log_level),
        )
        if v is not None
    }
    config = replace(config, server=replace(server, **overrides))
    problems = server_problems(config.server, "command line")
    for problem in problems:
        print(f"epp: invalid configuration: {problem}", file=sys.stderr)
    if problems:
        return 2
    if args.workers > 1:
        if redis_url:
            # The workers read it where a secret belongs, not from their command line.
            os.environ[REDIS_URL_ENV] = redis_url
        return _serve_workers(args, config)
    setup_logging(config.server.log_level)
    sources = {}
    if args.pool_name:
        try:
            sources = kubernetes_override(
                config.pools, args.pool_name, args.pool_namespace, args.kubeconfig
            )
        except ValueError as exc:
            print(f"epp: {exc}", file=sys.stderr)
            return 2
    return serve(
        Path(args.config), config, loaded=loaded, discovery=DiscoveryOptions(sources, args.eds_dir)
    )


def _serve_workers(args: argparse.Namespace, config: Config) -> int:
    """``--workers N``: N ``epp serve`` processes with the same flags, on their own ports."""
    from epp import workers

    problem = workers.problem(config, args.workers)
    if problem is not None:
        print(f"epp: invalid configuration: {problem}", file=sys.stderr)
        return 2
    base = [sys.executable, "-m", "epp", "serve", "--config", str(args.config)]
    for flag, value in (
        ("--host", args.host),
        ("--log-level", args.log_level),
        ("--pool-name", args.pool_name),
        ("--pool-namespace", args.pool_namespace if args.pool_name else None),
        ("--kubeconfig", args.kubeconfig),
        ("--eds-dir", args.eds_dir),
    ):
        if value is not None:
            base += [flag, value]
    return workers.run(config, args.workers, base)


def _check_config(args: argparse.Namespace) -> int:
    """Validate exactly as ``serve`` does at start and on reload; every error on its own line."""
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        for error in exc.errors:
            print(error)
        count = len(exc.errors)
        print(f"{args.file}: {count} error{'s' if count != 1 else ''}", file=sys.stderr)
        return 1
    for warning in advice(config):
        print(f"{args.file}: warning: {warning}")
    print(f"{args.file}: valid")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from epp.devstack import add_subcommand as add_dev
    from epp.envoy_config import add_subcommand as add_envoy_config
    from epp.pd.sidecar import add_subcommand as add_pd_sidecar
    from epp.sim.cli import add_subcommand as add_sim

    parser = argparse.ArgumentParser(prog="epp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc endpoint picker")
    serve.add_argument("--config", "-c", required=True, help="epp YAML configuration file")
    redis = serve.add_mutually_exclusive_group()
    redis.add_argument(
        "--redis-url",
        help=f"share state through Redis (overrides store.redis_url; default ${REDIS_URL_ENV}); "
        "a password here shows in the process list: prefer --redis-url-file",
    )
    redis.add_argument(
        "--redis-url-file", help="read the Redis URL from this file (a mounted secret)"
    )
    serve.add_argument("--host", help="listen address (default from config: 0.0.0.0)")
    # GIE's EPP flag names are accepted too, so manifests written for it carry over.
    serve.add_argument(
        "--port", "--grpc-port", dest="port", type=int, help="ext_proc gRPC port (default 9002)"
    )
    serve.add_argument(
        "--health-port",
        "--grpc-health-port",
        dest="health_port",
        type=int,
        help="gRPC health port (default 9003)",
    )
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (default 9090)")
    serve.add_argument(
        "--pool-name",
        help="feed the configured pool from this InferencePool's pods (docs/discovery.md)",
    )
    serve.add_argument(
        "--pool-namespace", default="default", help="namespace of --pool-name (default: default)"
    )
    serve.add_argument(
        "--kubeconfig",
        help="kubeconfig file for --pool-name (default: the pod's service account)",
    )
    serve.add_argument(
        "--eds-dir",
        help="write Envoy's EDS file here (the directory given to epp envoy-config --eds-dir)",
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="run N supervised epp processes sharing state through Redis, worker i on ports "
        "+10i (ext_proc, health) and +i (metrics); docs/workers.md",
    )
    serve.set_defaults(func=_serve)

    check = sub.add_parser(
        "check-config",
        help="validate a configuration file as serve would; exit 0 if valid, 1 if not",
    )
    check.add_argument("file", help="epp YAML configuration file")
    check.set_defaults(func=_check_config)

    add_sim(sub)
    add_envoy_config(sub)
    add_dev(sub)
    add_pd_sidecar(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
