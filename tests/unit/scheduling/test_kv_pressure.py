"""kv-pressure-scorer: penalise only where projected KV demand nears the cache's size."""

from __future__ import annotations

import pytest

from epp.config import parse_config
from epp.scheduling import build_profile
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.scheduling.scorers.kv_pressure import KvPressureParams, KvPressureScorer
from epp.state import EndpointState
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import cycle, ep, req

# 1001 blocks of 16 tokens: 16,000 usable tokens (vLLM keeps one null block).
CAPACITY = 16_000


def geometry(address: str, kv_usage: float = 0.0) -> EndpointState:
    return ep(address, kv_usage=kv_usage, num_gpu_blocks=1001, block_size=16)


def test_no_penalty_below_start_then_linear_to_zero_at_full() -> None:
    """A 100-token request (24-token prompt + 76 output) on caches 0-100% used: scores are 1
    up to ``start`` of the cache, half way between ``start`` and full, 0 beyond."""
    request = req("x" * 92, max_tokens=76)  # 92 // 4 + 1 = 24 prompt tokens
    assert request.expected_tokens() == 100
    used = {"idle": 0, "at-start": 12_700, "half-way": 14_300, "full": 15_900, "over": 15_990}
    eps = [geometry(name, tokens / CAPACITY) for name, tokens in used.items()]
    scores = KvPressureScorer(KvPressureParams(start=0.8)).score(request, eps, cycle())
    assert scores == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0], abs=1e-9)


def test_epps_own_in_flight_work_counts_before_the_scrape_shows_it() -> None:
    """A burst epp routed since the last scrape (usage still 0) already fills the cache."""
    fleet = FleetState()
    fleet.inflight.add("busy", 15_000)
    eps = [geometry("busy"), geometry("quiet")]
    scores = KvPressureScorer().score(req("x" * 4000, max_tokens=500), eps, cycle(fleet))
    assert scores[0] == 0.0
    assert scores[1] == 1.0


def test_the_larger_of_scrape_and_own_count_is_the_demand() -> None:
    """Usage the scrape shows but epp did not route (other gateways) counts too, without
    adding epp's own requests on top of the scrape that already includes them."""
    fleet = FleetState()
    fleet.inflight.add("a", 8_000)
    request = req("", max_tokens=6_300)  # 1 prompt token + 6,300 output
    # a: own 8,000 vs scraped 4,000 -> 8,000 + 6,301 = 14,301 (89%); b: scraped 12,000 -> 115%.
    eps = [geometry("a", 0.25), geometry("b", 0.75)]
    scores = KvPressureScorer(KvPressureParams(start=0.8)).score(request, eps, cycle(fleet))
    assert scores == pytest.approx([(1 - 14_301 / CAPACITY) / 0.2, 0.0])


def test_cached_prompt_tokens_need_no_new_blocks() -> None:
    request = req("x" * 40_000, max_tokens=0)  # 10,001 prompt tokens
    c = cycle()
    c.put(CACHED_TOKENS, {"warm": 10_000})
    eps = [geometry("warm", 0.5), geometry("cold", 0.5)]
    warm, cold = KvPressureScorer(KvPressureParams(start=0.5)).score(request, eps, c)
    assert warm == pytest.approx((1 - 8_001 / CAPACITY) / 0.5)
    assert cold == 0.0


def test_protect_tokens_keeps_a_long_cached_history_where_it_is() -> None:
    """Two endpoints are full. "history" caches 3,000 more of the prompt's tokens than
    the only endpoint with room: moving would recompute them, so its pressure is waived. With
    a short cached prefix (LoRA task prompt) the same pressure still counts."""
    request = req("x" * 16_000, max_tokens=100)  # 4,001 prompt tokens
    eps = [geometry("history", 0.97), geometry("short", 0.97), geometry("roomy", 0.1)]
    c = cycle()
    c.put(CACHED_TOKENS, {"history": 3_500, "short": 1_000, "roomy": 500})
    plain = KvPressureScorer().score(request, eps, c)
    protected = KvPressureScorer(KvPressureParams(protect_tokens=2048)).score(request, eps, c)
    assert plain[0] == plain[1] == 0.0
    assert protected == [1.0, 0.0, 1.0]


def test_protect_tokens_without_any_roomy_endpoint_stays_with_the_cache() -> None:
    request = req("x" * 16_000, max_tokens=100)
    eps = [geometry("history", 0.99), geometry("cold", 0.99)]
    c = cycle()
    c.put(CACHED_TOKENS, {"history": 3_500})
    assert KvPressureScorer(KvPressureParams(protect_tokens=2048)).score(request, eps, c) == [
        1.0,
        0.0,
    ]


def test_unknown_cache_geometry_scores_one() -> None:
    assert KvPressureScorer().score(req("x"), [ep("unscraped", kv_usage=1.0)], cycle()) == [1.0]


@pytest.mark.parametrize("start", [-0.1, 1.0, 2])
def test_start_must_leave_room_to_fall(start: float) -> None:
    with pytest.raises(ValueError, match="start"):
        KvPressureScorer(KvPressureParams(start=start))


def test_protect_tokens_cannot_be_negative() -> None:
    with pytest.raises(ValueError, match="protect_tokens"):
        KvPressureScorer(KvPressureParams(protect_tokens=-1))


def test_configurable_by_name_in_a_profile() -> None:
    scorer_entry = {"plugin": "kv-pressure-scorer", "weight": 2, "parameters": {"start": 0.6}}
    config = parse_config(
        {
            "models": {"m": {"pools": ["a"]}},
            "pools": {"a": {"endpoints": ["127.0.0.1:8001"]}},
            "scheduling": {
                "profile": "p",
                "profiles": {"p": [scorer_entry, {"plugin": "max-score-picker"}]},
            },
        }
    )
    ((scorer, weight),) = build_profile(config.scheduling.selected).scorers
    assert isinstance(scorer, KvPressureScorer)
    assert (scorer.start, weight) == (0.6, 2)
