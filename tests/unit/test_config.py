"""Configuration validation: good files load, bad ones fail with the bad key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.config import ConfigError, load_config, parse_config
from epp.scheduling.pickers.max_score import MaxScorePicker
from epp.scheduling.scorers.queue import QueueScorer

BASE = {
    "models": {"tiny": {"pools": ["a"]}, "big": {"pools": ["a", "b"]}},
    "pools": {
        "a": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]},
        "b": {"endpoints": ["[::1]:8003"]},
    },
}


def with_(**sections: object) -> dict[str, object]:
    return {**BASE, **sections}


def test_defaults_and_model_resolution() -> None:
    config = parse_config(BASE)
    assert config.endpoints_for_model("big") == ("127.0.0.1:8001", "127.0.0.1:8002", "[::1]:8003")
    assert config.endpoints_for_model("nope") is None
    assert config.scrape.interval == 0.05
    assert config.server.extproc_port == 9002
    assert [w for _, w in config.profile.scorers] == [3.0, 3.0, 1.0, 3.0, 2.0]
    assert isinstance(config.profile.picker, MaxScorePicker)


def test_named_plugins_and_profiles() -> None:
    config = parse_config(
        with_(
            scheduling={
                "profile": "fast",
                "plugins": [{"name": "q", "type": "queue-scorer"}],
                "profiles": {
                    "fast": [
                        {"plugin": "q", "weight": 5},
                        {"pluginRef": "max-score-picker", "parameters": {"seed": 1}},
                    ]
                },
            }
        )
    )
    ((scorer, weight),) = config.profile.scorers
    assert isinstance(scorer, QueueScorer)
    assert scorer.name == "q"
    assert weight == 5


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"pools": BASE["pools"]}, "models: is required"),
        (with_(models={"tiny": {"pools": ["zzz"]}}), "models.tiny.pools[0]: unknown pool 'zzz'"),
        (with_(pools={"a": {"endpoints": ["nohost"]}}), "pools.a.endpoints[0]"),
        (with_(pools={"a": {"endpoints": ["127.0.0.1:70000"]}}), "pools.a.endpoints[0]"),
        (with_(pools={"a": {"endpoints": []}}), "pools.a.endpoints: must list"),
        (
            with_(pools={"a": {"endpoints": ["127.0.0.1:1"]}, "b": {"endpoints": ["127.0.0.1:1"]}}),
            "pools.b.endpoints[0]: 127.0.0.1:1 is already an endpoint of pool 'a'",
        ),
        (with_(scrape={"interval": "fast"}), "scrape.interval: must be float"),
        (with_(scrape={"interval": 0}), "scrape.interval: must be > 0"),
        (with_(scrape={"failure_threshold": 0}), "scrape.failure_threshold"),
        (with_(routing={"fallbacks": -1}), "routing.fallbacks"),
        (with_(routng={}), "routng: unknown key"),
        (with_(store={"backend": "etcd"}), "store.backend"),
        (with_(server={"log_level": "loud"}), "server.log_level"),
        (
            with_(scheduling={"profiles": {"default": [{"plugin": "nope"}]}}),
            "scheduling.profiles.default[0]: unknown plugin type 'nope'",
        ),
        (
            with_(scheduling={"profiles": {"default": [{"plugin": "queue-scorer"}]}}),
            "exactly one picker",
        ),
        (
            with_(
                scheduling={
                    "profiles": {
                        "default": [{"plugin": "max-score-picker", "parameters": {"bogus": 1}}]
                    }
                }
            ),
            "bad parameters for 'max-score-picker'",
        ),
        (with_(scheduling={"profile": "missing", "profiles": {}}), "scheduling.profile"),
    ],
)
def test_errors_name_the_bad_key(data: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert where in str(info.value)


def test_load_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
