"""``pools.P.engine``: which engine serves a pool's replicas, validated."""

from __future__ import annotations

import pytest

from epp.config import ENGINES, ConfigError, parse_config
from epp.sources.scraper import PARSERS


def config(**pool: object) -> dict[str, object]:
    return {
        "models": {"m": {"pools": ["a", "b"]}},
        "pools": {
            "a": {"endpoints": ["127.0.0.1:8001"], **pool},
            "b": {"endpoints": ["127.0.0.1:8002"]},
        },
    }


def test_vllm_is_the_default_and_is_not_listed() -> None:
    assert parse_config(config()).engines == {}
    assert parse_config(config(engine="vllm")).engines == {}


def test_an_sglang_pool_is_listed() -> None:
    assert parse_config(config(engine="sglang")).engines == {"a": "sglang"}


def test_a_discovered_pool_may_name_its_engine() -> None:
    data = {
        "models": {"m": {"pools": ["a"]}},
        "pools": {
            "a": {"discovery": {"dns": {"name": "sglang.local", "port": 30000}}, "engine": "sglang"}
        },
    }
    assert parse_config(data).engines == {"a": "sglang"}


@pytest.mark.parametrize("engine", ["SGLang", "tgi", ""])
def test_an_unknown_engine_is_refused_with_its_key(engine: object) -> None:
    with pytest.raises(ConfigError, match=r"pools\.a\.engine: must be one of vllm, sglang"):
        parse_config(config(engine=engine))


def test_an_engine_must_be_a_string() -> None:
    with pytest.raises(ConfigError, match=r"pools\.a\.engine: must be a string, got 3"):
        parse_config(config(engine=3))


def test_every_engine_has_a_parser() -> None:
    assert set(ENGINES) == set(PARSERS)
