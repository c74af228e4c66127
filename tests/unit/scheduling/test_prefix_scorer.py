"""prefix-cache-scorer: matched fraction, shared per-request match, post-pick learning."""

from __future__ import annotations

import pytest

from epp.config import parse_config
from epp.prefix.approximate import approx_prefix
from epp.prefix.hashing import BlockHasher
from epp.request import InferenceRequest
from epp.scheduling import build_profile
from epp.scheduling.prefix_data import APPROX_PREFIX, CACHED_TOKENS
from epp.scheduling.scorers.prefix import PrefixCacheScorer, PrefixParams
from epp.scheduling.scorers.ttft import TtftParams
from epp.state import EndpointState
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import cycle, ep, profile_of, req, scored, text

EPS = [ep(f"10.0.0.{i}:8000") for i in range(4)]


def test_score_is_matched_over_total_blocks_and_match_is_published() -> None:
    fleet = FleetState()
    prompt = text("p", 64 * 8)
    hashes = BlockHasher().hashes(req(prompt))
    fleet.states.get(approx_prefix()).insert(EPS[0].address, hashes[:8], 1000)
    fleet.states.get(approx_prefix()).insert(EPS[1].address, hashes[:2], 1000)
    c = cycle(fleet)
    assert scored(PrefixCacheScorer(), req(prompt), EPS, c) == [1.0, 0.25, 0.0, 0.0]
    match = c.get(APPROX_PREFIX)
    assert match is not None
    assert match.blocks == {e.address: n for e, n in zip(EPS, [8, 2, 0, 0], strict=True)}
    # 64-character blocks stand for 16 tokens each: what a TTFT estimate subtracts.
    assert match.cached_tokens == {a: n * 16 for a, n in match.blocks.items()}


def test_prompt_shorter_than_a_block_scores_zero() -> None:
    assert scored(PrefixCacheScorer(), req("short"), EPS, cycle()) == [0.0] * 4


def test_hashes_are_computed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default profile's filter, scorers, hooks and the router all read one match."""
    calls: list[InferenceRequest] = []
    original = BlockHasher.hashes

    def counting(self: BlockHasher, request: InferenceRequest) -> list[int]:
        calls.append(request)
        return original(self, request)

    monkeypatch.setattr(BlockHasher, "hashes", counting)
    base = {"models": {"m": {"pools": ["p"]}}, "pools": {"p": {"endpoints": ["10.0.0.1:1"]}}}
    profile = build_profile(parse_config(base).scheduling.selected)
    full = [geometry(e.address, free_blocks=1) for e in EPS]  # the headroom filter must look
    c = cycle()
    request = req(text("p", 640))
    profile.run(request, full, c, count=2)
    assert len(calls) == 1
    match = c.get(APPROX_PREFIX)
    assert match is not None
    assert set(match.blocks) == {e.address for e in EPS}


def geometry(address: str, free_blocks: int) -> EndpointState:
    return ep(address, kv_usage=1 - free_blocks / 1000, num_gpu_blocks=1001, block_size=16)


def test_a_repeated_prefix_goes_back_to_the_same_endpoint() -> None:
    fleet = FleetState()
    profile = profile_of(("prefix-cache-scorer", PrefixParams(), 1.0), seed=3)
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
    scorer = PrefixCacheScorer(PrefixParams(lru_capacity=5))
    small = ep("small", num_gpu_blocks=4, block_size=16)
    big_blocks = ep("big-blocks", num_gpu_blocks=4, block_size=32)
    unknown = ep("unknown")
    for i in range(3):
        request = req(text(f"p{i}", 64 * 6))
        for endpoint in (small, big_blocks, unknown):
            c = cycle(fleet)
            scorer.produce(request, [endpoint], c)
            scorer.on_pick(request, endpoint, c)
    assert fleet.states.get(approx_prefix()).size("small") == 4
    # 4 blocks of 32 tokens hold 8 index blocks of 16 tokens.
    assert fleet.states.get(approx_prefix()).size("big-blocks") == 8
    assert fleet.states.get(approx_prefix()).size("unknown") == 5


def test_token_prompts_use_token_blocks() -> None:
    fleet = FleetState()
    scorer = PrefixCacheScorer(PrefixParams(block_size=4))
    ids = tuple(range(40))
    first = cycle(fleet)
    scorer.produce(req(tokens=ids), EPS, first)
    scorer.on_pick(req(tokens=ids), EPS[0], first)
    c = cycle(fleet)
    assert scored(scorer, req(tokens=(*ids[:20], 7, 7, 7, 7)), EPS[:2], c) == [5 / 6, 0.0]
    match = c.get(APPROX_PREFIX)
    assert match is not None
    assert match.cached_tokens[EPS[0].address] == 20


@pytest.mark.parametrize("ttft_first", [False, True])
def test_ttft_scorer_reads_the_published_cached_tokens(ttft_first: bool) -> None:
    """The TTFT scorer sees a warm endpoint's prefill as shorter, listed before the prefix
    scorer or after it."""
    fleet = FleetState()
    prompt = text("p", 64 * 40)
    warm = cycle(fleet)
    PrefixCacheScorer().produce(req(prompt), EPS, warm)
    PrefixCacheScorer().on_pick(req(prompt), EPS[1], warm)
    entries = [("prefix-cache-scorer", PrefixParams(), 0.0), ("ttft-scorer", TtftParams(), 1.0)]
    profile = profile_of(*(reversed(entries) if ttft_first else entries))
    c = cycle(fleet)
    decision = profile.run(req(prompt), EPS, c, count=1, explain=True)
    assert decision.scores is not None
    ttft = [decision.scores[e.address]["ttft-scorer"] for e in EPS]
    assert ttft[1] == 1.0
    assert max(ttft[0], ttft[2], ttft[3]) < 0.2
    assert c.get(CACHED_TOKENS) == {e.address: 640 if e is EPS[1] else 0 for e in EPS}
