"""prefix-cache-scorer: matched fraction, shared per-request match, post-pick learning."""

from __future__ import annotations

import pytest

from epp.prefix.hashing import BlockHasher
from epp.request import InferenceRequest
from epp.scheduling import Profile
from epp.scheduling.pickers.max_score import MaxScorePicker
from epp.scheduling.scorers.prefix import (
    CACHED_TOKENS_KEY,
    MATCH_KEY,
    PrefixCacheScorer,
    prefix_match,
)
from epp.scheduling.scorers.ttft import TtftScorer
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import cycle, ep, req, text

EPS = [ep(f"10.0.0.{i}:8000") for i in range(4)]


def test_score_is_matched_over_total_blocks_and_match_is_published() -> None:
    fleet = FleetState()
    prompt = text("p", 64 * 8)
    hashes = BlockHasher().hashes(req(prompt))
    fleet.prefix.insert(EPS[0].address, hashes[:8], 1000)
    fleet.prefix.insert(EPS[1].address, hashes[:2], 1000)
    c = cycle(fleet)
    assert PrefixCacheScorer().score(req(prompt), EPS, c) == [1.0, 0.25, 0.0, 0.0]
    match = c.data[MATCH_KEY]
    assert match.blocks == {e.address: n for e, n in zip(EPS, [8, 2, 0, 0], strict=True)}
    # 64-character blocks stand for 16 tokens each: what a TTFT estimate subtracts.
    assert c.data[CACHED_TOKENS_KEY] == {a: n * 16 for a, n in match.blocks.items()}


def test_prompt_shorter_than_a_block_scores_zero() -> None:
    assert PrefixCacheScorer().score(req("short"), EPS, cycle()) == [0.0] * 4


def test_hashes_are_computed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[InferenceRequest] = []
    original = BlockHasher.hashes

    def counting(self: BlockHasher, request: InferenceRequest) -> list[int]:
        calls.append(request)
        return original(self, request)

    monkeypatch.setattr(BlockHasher, "hashes", counting)
    c = cycle()
    request = req(text("p", 640))
    scorer = PrefixCacheScorer()
    prefix_match(request, EPS[:2], c, scorer.hasher)
    scorer.score(request, EPS, c)
    scorer.on_pick(request, EPS[3], c)
    assert len(calls) == 1
    assert set(c.data[MATCH_KEY].blocks) == {e.address for e in EPS}


def test_a_repeated_prefix_goes_back_to_the_same_endpoint() -> None:
    fleet = FleetState()
    scorer = PrefixCacheScorer()
    profile = Profile("t", [], [(scorer, 1.0)], MaxScorePicker(seed=3), [scorer])
    system = text("system", 64 * 20)

    def route(prompt: str) -> str:
        return profile.run(req(prompt), EPS, cycle(fleet), count=1).endpoints[0].address

    first = route(system + text("q0", 200))
    assert {route(system + text(f"q{i}", 200)) for i in range(1, 10)} == {first}
    # Prompts without a shared prefix land anywhere (random ties): the index does not pin them.
    others = {route(text(f"unrelated {i}", 400)) for i in range(40)}
    assert len(others) > 1


def test_post_pick_sizes_the_lru_from_the_endpoints_kv_cache() -> None:
    fleet = FleetState()
    scorer = PrefixCacheScorer(lru_capacity=5)
    small = ep("small", num_gpu_blocks=4, block_size=16)
    big_blocks = ep("big-blocks", num_gpu_blocks=4, block_size=32)
    unknown = ep("unknown")
    for i in range(3):
        request = req(text(f"p{i}", 64 * 6))
        for endpoint in (small, big_blocks, unknown):
            scorer.on_pick(request, endpoint, cycle(fleet))
    assert fleet.prefix.size("small") == 4
    # 4 blocks of 32 tokens hold 8 index blocks of 16 tokens.
    assert fleet.prefix.size("big-blocks") == 8
    assert fleet.prefix.size("unknown") == 5


def test_token_prompts_use_token_blocks() -> None:
    fleet = FleetState()
    scorer = PrefixCacheScorer(block_size=4)
    ids = tuple(range(40))
    scorer.on_pick(req(tokens=ids), EPS[0], cycle(fleet))
    c = cycle(fleet)
    assert scorer.score(req(tokens=(*ids[:20], 7, 7, 7, 7)), EPS[:2], c) == [5 / 6, 0.0]
    assert c.data[CACHED_TOKENS_KEY][EPS[0].address] == 20


def test_ttft_scorer_reads_the_published_cached_tokens() -> None:
    """The TTFT scorer, listed after this one, sees a warm endpoint's prefill as shorter."""
    fleet = FleetState()
    prompt = text("p", 64 * 40)
    PrefixCacheScorer().on_pick(req(prompt), EPS[1], cycle(fleet))
    c = cycle(fleet)
    PrefixCacheScorer().score(req(prompt), EPS, c)
    ttft = TtftScorer().score(req(prompt), EPS, c)
    assert ttft[1] == 1.0
    assert max(ttft[0], ttft[2], ttft[3]) < 0.2
