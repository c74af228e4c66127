"""``epp serve`` accepts GIE's flag names and refuses an ambiguous --pool-name up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from epp.cli import build_parser, main


def test_gie_flag_names() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "-c",
            "epp.yaml",
            "--grpc-port",
            "9102",
            "--grpc-health-port",
            "9103",
            "--metrics-port",
            "9190",
            "--pool-name",
            "vllm-pool",
            "--pool-namespace",
            "prod",
        ]
    )
    assert (args.port, args.health_port, args.metrics_port) == (9102, 9103, 9190)
    assert (args.pool_name, args.pool_namespace) == ("vllm-pool", "prod")


def test_pool_name_with_several_pools_and_none_of_that_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "epp.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": {"m": {"pools": ["a", "b"]}},
                "pools": {"a": {"endpoints": ["10.0.0.1:1"]}, "b": {"endpoints": ["10.0.0.2:1"]}},
            }
        )
    )
    assert main(["serve", "-c", str(config), "--pool-name", "vllm-pool"]) == 2
    assert "rename the pool" in capsys.readouterr().err
