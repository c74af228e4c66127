"""Configuration validation: good files load, bad ones fail with the bad key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.config import ConfigError, load_config, parse_config
from epp.scheduling import build_profile
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
    profile = build_profile(config.scheduling.selected)
    scorers = profile.scorers
    assert {s.name: w for s, w in scorers} == {
        "prefix-cache-scorer": 3.0,
        "session-affinity-scorer": 3.0,
        "lora-affinity-scorer": 1.0,
        "inflight-load-scorer": 3.0,
        "ttft-scorer": 4.0,
    }
    assert isinstance(profile.picker, MaxScorePicker)


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
    ((scorer, weight),) = build_profile(config.scheduling.selected).scorers
    assert isinstance(scorer, QueueScorer)
    assert scorer.name == "q"
    assert weight == 5


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"pools": BASE["pools"]}, "models: must be set"),
        (
            with_(models={"tiny": {"pools": ["zzz"]}}),
            "models.tiny.pools[0]: must name a pool, got unknown pool 'zzz'",
        ),
        (with_(pools={"a": {"endpoints": ["nohost"]}}), "pools.a.endpoints[0]"),
        (with_(pools={"a": {"endpoints": ["127.0.0.1:70000"]}}), "pools.a.endpoints[0]"),
        (with_(pools={"a": {"endpoints": []}}), "pools.a.endpoints: must list"),
        (
            with_(pools={"a": {"endpoints": ["127.0.0.1:1"]}, "b": {"endpoints": ["127.0.0.1:1"]}}),
            "pools.b.endpoints[0]: must be unique: 127.0.0.1:1 is already an endpoint of pool 'a'",
        ),
        (with_(scrape={"interval": "fast"}), "scrape.interval: must be a number, got 'fast'"),
        (with_(scrape={"interval": 0}), "scrape.interval: must be a number > 0, got 0"),
        (with_(scrape={"failure_threshold": 0}), "scrape.failure_threshold"),
        (with_(routing={"fallbacks": -1}), "routing.fallbacks: must be an integer >= 0, got -1"),
        (with_(routng={}), "routng: must be one of the known keys"),
        (with_(store={"backend": "etcd"}), "store.backend"),
        (with_(server={"log_level": "loud"}), "server.log_level"),
        (
            with_(scheduling={"profiles": {"default": [{"plugin": "nope"}]}}),
            "scheduling.profiles.default[0].plugin: must be a plugin type, got 'nope'",
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
            "scheduling.profiles.default[0].parameters.bogus: "
            "must be one of the plugin's parameters: seed",
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


def test_every_problem_is_reported_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config([1, 2])
    assert info.value.errors == ["<config>: (top level): must be a mapping, got list"]
    with pytest.raises(ConfigError) as info:
        parse_config(None)
    assert info.value.errors == ["<config>: pools: must be set", "<config>: models: must be set"]
    data = with_(
        pools={"a": {"endpoints": 5}},
        scheduling={"profiles": {"x": 3}},
        scrape={"interval": -1, "timeout": "soon"},
    )
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.errors == [
        "<config>: pools.a.endpoints: must be a list, got int",
        "<config>: scrape.interval: must be a number > 0, got -1.0",
        "<config>: scrape.timeout: must be a number, got 'soon'",
        "<config>: models.big.pools[1]: must name a pool, got unknown pool 'b' (pools: a)",
        "<config>: scheduling.profiles.x: must be a list, got int",
    ]


def test_an_empty_profile_is_refused_not_run() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_(scheduling={"profile": "p", "profiles": {"p": None}}))
    assert info.value.errors == [
        "<config>: scheduling.profiles.p: must list exactly one picker, found 0"
    ]
