"""The declarative configuration schema: one walk reports every problem with its path, the
reference in docs/configuration.md is generated from the declarations, and each key's reload
policy is declared once."""

from __future__ import annotations

import dataclasses

import pytest

from epp.admission.budgets import Limits
from epp.config import SECTIONS, ConfigError, File, Reload, parse_config
from epp.config.file import reload_policy
from epp.config.reference import BEGIN, DOCUMENT, END, main, reference, rewritten
from epp.config.sections import (
    AutoscalingSection,
    EdgeSection,
    HealthSection,
    LimitsSection,
    TracingSection,
)
from epp.edge import EdgeLimits
from epp.metrics.demand import DemandPolicy
from epp.state.health import HealthConfig
from epp.tracing import TracingConfig

BASE = {
    "models": {"m": {"pools": ["main"]}},
    "pools": {"main": {"endpoints": ["127.0.0.1:8001"]}},
}


def test_every_problem_of_every_section_is_reported_in_one_error_with_its_path() -> None:
    data = {
        "models": {"m": {"pools": ["main", "nope"]}},
        "pools": {
            "main": {"endpoints": ["127.0.0.1:8001"]},
            "dns": {"discovery": {"dns": {"name": "sim", "port": 0, "ttl": 3}}},
            "k8s": {"discovery": {"kubernetes": {"pool_name": "Bad_Name", "api_url": "ftp://x"}}},
        },
        "scrape": {"interval": 0, "failure_threshold": 1.5},
        "admission": {"mode": "drop", "kv_threshold": 2},
        "health": {"max_ejection_percent": 101},
        "server": {"metrics_port": 9002},
        "unknown": {},
        "scheduling": {"plugins": [{"type": "prefix-cache-scorer", "parameters": {"x": 1}}]},
    }
    with pytest.raises(ConfigError) as refused:
        parse_config(data)
    assert refused.value.errors == [
        "<config>: unknown: must be one of the known keys: " + ", ".join(SECTIONS),
        "<config>: pools.dns.discovery.dns.ttl: must be one of the known keys: "
        "name, port, interval, resolver, role",
        "<config>: pools.dns.discovery.dns.port: must be an integer in [1, 65535], got 0",
        "<config>: pools.k8s.discovery.kubernetes.pool_name: must be a Kubernetes object name, "
        "got 'Bad_Name'",
        "<config>: pools.k8s.discovery.kubernetes.api_url: must be an http(s) URL, got 'ftp://x'",
        "<config>: scrape.interval: must be a number > 0, got 0.0",
        "<config>: scrape.failure_threshold: must be an integer, got 1.5",
        "<config>: models.m.pools[1]: must name a pool, got unknown pool 'nope' "
        "(pools: main, dns, k8s)",
        "<config>: scheduling.plugins[0].parameters.x: must be one of the plugin's parameters: "
        "block_chars, block_size, max_blocks, lru_capacity",
        "<config>: server.metrics_port: must differ from server.extproc_port, both 9002",
        "<config>: admission.mode: must be one of off, shed, queue, got 'drop'",
        "<config>: admission.kv_threshold: must be a fraction in (0, 1], got 2.0",
        "<config>: health.max_ejection_percent: must be a percentage in [0, 100], got 101.0",
    ]


def test_a_reload_policy_is_declared_per_key_and_inherited_from_its_section() -> None:
    assert reload_policy("scrape.interval") is Reload.APPLIED
    assert reload_policy("server.extproc_port") is Reload.RESTART
    assert reload_policy("server.tls") is Reload.RESTART
    assert reload_policy("pools.*.discovery.dns.interval") is Reload.APPLIED
    assert reload_policy("tracing") is Reload.RESTART
    # The table the reload logic reads is the sections' policies.
    assert SECTIONS["store"] is Reload.RESTART
    assert SECTIONS["health"] is Reload.APPLIED
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(File)]
    with pytest.raises(KeyError):
        reload_policy("scrape.intervall")


def test_the_reference_in_the_docs_is_generated_from_the_schema() -> None:
    text = DOCUMENT.read_text()
    assert rewritten(text) == text, "stale: run python -m epp.config.reference"
    assert main(["--check"]) == 0
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert "| `failure_threshold` | integer ≥ 1 | `3` |" in block
    assert "### `pools.NAME.discovery.dns`" in block
    assert "Restart-only: " in block


def test_a_stale_reference_is_found_and_only_its_block_rewritten() -> None:
    text = DOCUMENT.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    stale = f"{head}{BEGIN}\n| `interval` | an old row |\n{END}{tail}"
    assert rewritten(stale) != stale
    assert rewritten(stale) == text
    assert rewritten(stale).startswith(head)
    assert rewritten(stale).endswith(tail)
    with pytest.raises(ValueError, match="markers"):
        rewritten("# no markers")
    assert reference().count("### `") > len(SECTIONS)


@pytest.mark.parametrize(
    ("schema", "code"),
    [
        (HealthSection, HealthConfig),
        (EdgeSection, EdgeLimits),
        (TracingSection, TracingConfig),
        (AutoscalingSection, DemandPolicy),
        (LimitsSection, Limits),
    ],
)
def test_a_section_declares_the_keys_and_defaults_of_the_class_the_code_reads(
    schema: type, code: type
) -> None:
    declared = {f.name: f.default for f in dataclasses.fields(schema)}
    read = {f.name: f.default for f in dataclasses.fields(code)}
    assert declared == read
