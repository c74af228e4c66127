"""no-hit-lru-scorer: prompts cached nowhere are spread over the endpoints in turn."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.config import ConfigError, parse_config
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.scheduling.scorers.no_hit_lru import COLD_PICKS, NoHitLruParams, NoHitLruScorer
from epp.scheduling.scorers.prefix import PrefixParams
from epp.state.cold_picks import ColdPicks
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import cycle, ep, profile_of, req, text

EPS = [ep(a) for a in ("a", "b", "c", "d")]


def test_ranks_put_never_used_endpoints_first_then_the_least_recent() -> None:
    picks = ColdPicks()
    assert picks.ranks(["a", "b", "c"]) == [0, 1, 2]
    picks.record("b")
    picks.record("a")
    assert picks.ranks(["a", "b", "c"]) == [2, 1, 0]
    picks.record("b")
    assert picks.ranks(["a", "b", "c"]) == [1, 2, 0]


def test_the_oldest_entry_is_dropped_past_the_limit_and_ranks_as_never_used() -> None:
    picks = ColdPicks(limit=2)
    for address in ("a", "b", "c"):
        picks.record(address)
    assert picks.ranks(["c", "b", "a"]) == [2, 1, 0]


def test_cold_prompts_go_round_the_endpoints() -> None:
    scorer = NoHitLruScorer()
    fleet = FleetState()
    chosen = []
    for n in range(8):
        c = cycle(fleet)
        scores = scorer.score(req(text(f"group-{n}", 4000)), EPS, c)
        best = EPS[scores.index(max(scores))]
        scorer.on_pick(req(text(f"group-{n}", 4000)), best, c)
        chosen.append(best.address)
    assert chosen == ["a", "b", "c", "d"] * 2
    # The scores are linear in the rank: the next in line 1, the last served 0.
    assert scorer.score(req("x" * 400), EPS, cycle(fleet)) == [1.0, 2 / 3, 1 / 3, 0.0]


def test_a_warm_prompt_is_left_to_cache_affinity_and_not_counted() -> None:
    scorer = NoHitLruScorer(NoHitLruParams(cold_below=0.3))
    fleet = FleetState()
    request = req("x" * 3996)
    assert request.prompt_tokens() == 1000
    c = cycle(fleet)
    c.put(CACHED_TOKENS, {"c": 300})
    assert scorer.score(request, EPS, c) == [1.0] * 4
    scorer.on_pick(request, EPS[2], c)
    assert fleet.states.get(COLD_PICKS).ranks(["a", "b", "c", "d"]) == [0, 1, 2, 3]
    # Below the share it is cold: the order decides, and the pick is remembered.
    c = cycle(fleet)
    c.put(CACHED_TOKENS, {"c": 299})
    assert scorer.score(request, EPS, c) == [1.0, 2 / 3, 1 / 3, 0.0]
    scorer.on_pick(request, EPS[0], c)
    assert fleet.states.get(COLD_PICKS).ranks(["a", "b", "c", "d"]) == [3, 0, 1, 2]


def test_in_a_profile_new_groups_spread_evenly_and_their_followers_stay_home() -> None:
    """Through the built profile with the approximate prefix scorer: 8 groups' founders land
    two per endpoint (load alone would not say where: nothing is in flight), and every later
    request of a group follows its founder."""
    profile = profile_of(
        ("prefix-cache-scorer", PrefixParams(), 3.0),
        ("no-hit-lru-scorer", NoHitLruParams(), 3.0),
    )
    fleet = FleetState()
    homes: dict[int, str] = {}
    for round_ in range(3):
        for group in range(8):
            prompt = text(f"system-{group}", 2400) + text(f"q-{round_}-{group}", 200)
            decision = profile.run(req(prompt), EPS, cycle(fleet), 1, False)
            address = decision.endpoints[0].address
            assert homes.setdefault(group, address) == address, (group, round_)
    assert Counter(homes.values()) == {"a": 2, "b": 2, "c": 2, "d": 2}


def test_bad_parameters_are_refused_at_load() -> None:
    with pytest.raises(ValueError, match="cold_below"):
        NoHitLruParams(cold_below=0)
    entry = {"plugin": "no-hit-lru-scorer", "weight": 1, "parameters": {"cold_below": 1.5}}
    config = {
        "models": {"m": {"pools": ["p"]}},
        "pools": {"p": {"endpoints": ["127.0.0.1:1"]}},
        "scheduling": {"profile": "x", "profiles": {"x": [entry, {"plugin": "max-score-picker"}]}},
    }
    with pytest.raises(ConfigError, match="cold_below"):
        parse_config(config)
