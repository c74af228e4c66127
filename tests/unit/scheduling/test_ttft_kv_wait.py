"""ttft-scorer's KV-wait term: memory overflow priced in the same unit as cache affinity."""

from __future__ import annotations

import pytest

from epp.config import ConfigError, parse_config
from epp.scheduling import build_profile
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.scheduling.scorers.ttft import TtftParams, TtftScorer
from epp.state import EndpointState
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import cycle, ep, req

# 1001 blocks of 16 tokens: 16,000 usable tokens (vLLM keeps one null block).
CAPACITY = 16_000


def geometry(address: str, kv_usage: float = 0.0) -> EndpointState:
    return ep(address, kv_usage=kv_usage, num_gpu_blocks=1001, block_size=16)


def scores(
    factor: float, cached: dict[str, int], prompt_tokens: int, held: dict[str, int]
) -> list[float]:
    """Scores of a request with ``prompt_tokens`` (and 100 output) on endpoints holding
    ``held`` tokens of epp's in-flight work, with ``cached`` prompt tokens cached on each."""
    fleet = FleetState()
    for address, tokens in held.items():
        fleet.inflight.add(address, tokens)
    c = cycle(fleet)
    c.put(CACHED_TOKENS, cached)
    request = req("x" * 4 * (prompt_tokens - 1), max_tokens=100)
    assert request.prompt_tokens() == prompt_tokens
    return TtftScorer(TtftParams(kv_wait_factor=factor)).score(
        request, [geometry(a) for a in held], c
    )


def test_overflow_moves_a_short_cached_prefix_off_a_full_replica() -> None:
    """A LoRA-like request (768 of its 1,001 prompt tokens cached on "hot") whose KV would
    overflow "hot" by 1,333 tokens goes to the replica with room once memory has a price (233
    uncached + 1,333 against 1,001 cold), and stays on "hot" without it (233 against 1,001)."""
    held = {"hot": CAPACITY + 1_000, "roomy": 3_000}
    hot, roomy = scores(1.0, {"hot": 768}, 1_001, held)
    assert roomy == 1.0 > hot
    hot, roomy = scores(0.0, {"hot": 768}, 1_001, held)
    assert hot == 1.0 > roomy


def test_a_long_cached_history_stays_home_while_its_overflow_is_smaller() -> None:
    """A chat whose 3,000-token history is cached on "home": a 501-token overflow there costs
    less than recomputing the history on the roomy replica (201 + 501 against 3,201), so "home"
    still wins; a 5,301-token overflow tips it."""
    cached = {"home": 3_000}
    home, roomy = scores(1.0, cached, 3_201, {"home": CAPACITY + 200, "roomy": 3_000})
    assert home == 1.0 > roomy
    home, roomy = scores(1.0, cached, 3_201, {"home": CAPACITY + 5_000, "roomy": 3_000})
    assert roomy == 1.0 > home


def test_the_term_costs_nothing_below_the_caches_size() -> None:
    held = {"a": 10_000, "b": 14_000}
    with_term = scores(3.0, {"a": 500}, 1_001, held)
    assert with_term == pytest.approx(scores(0.0, {"a": 500}, 1_001, held))


def test_a_scraped_full_cache_counts_and_unknown_geometry_costs_nothing() -> None:
    """A replica the scrape shows full (other gateways' work) overflows by this request's own
    tokens; a replica whose cache size is not scraped yet is not charged."""
    eps = [ep("fresh"), geometry("full", kv_usage=1.0)]
    request = req("x" * 4_000, max_tokens=1_000)
    fresh, full = TtftScorer(TtftParams(kv_wait_factor=1.0)).score(request, eps, cycle())
    assert fresh == 1.0
    assert full == pytest.approx((1_001 + 64) / (1_001 + 2_001 + 64))
    with pytest.raises(ValueError, match="kv_wait_factor"):
        TtftScorer(TtftParams(kv_wait_factor=-1.0))


def test_the_factor_comes_from_the_profile_file_and_a_bad_one_names_its_key() -> None:
    def config(factor: float) -> dict[str, object]:
        entry = {"plugin": "ttft-scorer", "weight": 2, "parameters": {"kv_wait_factor": factor}}
        return {
            "models": {"m": {"pools": ["a"]}},
            "pools": {"a": {"endpoints": ["127.0.0.1:8001"]}},
            "scheduling": {
                "profile": "p",
                "profiles": {"p": [entry, {"plugin": "max-score-picker"}]},
            },
        }

    ((scorer, _),) = build_profile(parse_config(config(0.5)).scheduling.selected).scorers
    assert isinstance(scorer, TtftScorer)
    assert scorer.kv_wait_factor == 0.5
    bad = r"scheduling\.profiles\.p\[0\]\.parameters\.kv_wait_factor: must be a number >= 0"
    with pytest.raises(ConfigError, match=bad):
        parse_config(config(-1.0))
