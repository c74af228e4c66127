"""The ``epp`` command: ``serve``, ``sim``, ``envoy-config``, ``dev``."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from epp import __version__
from epp.config import ConfigError, StoreConfig, load_config
from epp.observability import setup_logging


def _serve(args: argparse.Namespace) -> int:
    from epp.server import serve

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"epp: invalid configuration: {exc}", file=sys.stderr)
        print("epp: fix the key named above and start again.", file=sys.stderr)
        return 2
    if args.redis_url:
        config = replace(
            config, store=StoreConfig("redis", args.redis_url, config.store.key_prefix)
        )
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
    setup_logging(config.server.log_level)
    return serve(Path(args.config), config)


def build_parser() -> argparse.ArgumentParser:
    from epp.devstack import add_subcommand as add_dev
    from epp.envoy_config import add_subcommand as add_envoy_config
    from epp.sim.cli import add_subcommand as add_sim

    parser = argparse.ArgumentParser(prog="epp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc endpoint picker")
    serve.add_argument("--config", "-c", required=True, help="epp YAML configuration file")
    serve.add_argument("--redis-url", help="share state through Redis (overrides store:)")
    serve.add_argument("--host", help="listen address (default from config: 0.0.0.0)")
    serve.add_argument("--port", type=int, help="ext_proc gRPC port (default 9002)")
    serve.add_argument("--health-port", type=int, help="gRPC health port (default 9003)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (default 9090)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=_serve)

    add_sim(sub)
    add_envoy_config(sub)
    add_dev(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
