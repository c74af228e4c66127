"""precise-prefix-cache-scorer: engine-reported matches, published data, speculative picks."""

from __future__ import annotations

import asyncio
import random

from epp.prefix.precise import PRECISE_INDEX, TOKENIZERS
from epp.prefix.tokens import TokenizerRegistry
from epp.request import InferenceRequest
from epp.scheduling import Cycle, PluginSpec, ProfileSpec, build_profile
from epp.scheduling.pickers.max_score import MaxScoreParams
from epp.scheduling.prefix_data import PRECISE_PREFIX, best_cached_tokens
from epp.scheduling.scorers.precise_prefix import PreciseParams, PrecisePrefixCacheScorer
from epp.sim.tokenization import BUNDLED_DIR
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import scored

BS = 16
PROMPT = tuple(range(1000, 1000 + 10 * BS))  # 10 full blocks


def ep(address: str, block_size: int | None = BS) -> EndpointState:
    return EndpointState(address, "pool", True, EndpointMetrics(block_size=block_size), 1.0)


def req(
    tokens: tuple[int, ...] | None = PROMPT, prompt: str = "", model: str = "tiny"
) -> InferenceRequest:
    return InferenceRequest("id", "/v1/completions", "completions", model, prompt, tokens)


def cycle(fleet: FleetState, now: float = 100.0) -> Cycle:
    return Cycle(Snapshot(), fleet, now=now)


def engine_stores(fleet: FleetState, endpoint: str, tokens: tuple[int, ...], n_blocks: int) -> None:
    """What the engine's BlockStored would make the subscriber do (hashes are arbitrary)."""
    hashes = [hash((endpoint, i)) & (2**64 - 1) for i in range(n_blocks)]
    fleet.states.get(PRECISE_INDEX).stored(endpoint, hashes, None, tokens[: n_blocks * BS], BS)


def test_score_is_engine_cached_blocks_over_full_blocks_and_tokens_are_published() -> None:
    fleet = FleetState()
    engine_stores(fleet, "a", PROMPT, 10)
    engine_stores(fleet, "b", PROMPT, 4)
    c = cycle(fleet)
    scores = scored(PrecisePrefixCacheScorer(), req(), [ep("a"), ep("b"), ep("c")], c)
    assert scores == [1.0, 0.4, 0.0]
    match = c.get(PRECISE_PREFIX)
    assert match is not None
    assert match.tokens == PROMPT
    # A full hit still recomputes the prompt's last block (vLLM caps hits at length - 1).
    assert match.cached_tokens == {"a": 9 * BS, "b": 4 * BS, "c": 0}
    assert best_cached_tokens(c) == match.cached_tokens


def test_each_endpoint_is_cut_in_its_own_block_size() -> None:
    fleet = FleetState()
    tokens = PROMPT[: 4 * 32]
    fleet.states.get(PRECISE_INDEX).stored("big", [1, 2], None, tokens[:64], 32)
    engine_stores(fleet, "small", tokens, 8)
    # "big" is not scraped yet: its events told the index its block size.
    scores = scored(
        PrecisePrefixCacheScorer(),
        req(tokens),
        [ep("big", block_size=None), ep("small")],
        cycle(fleet),
    )
    assert scores == [0.5, 1.0]


def test_unknown_block_size_or_tokens_score_zero_and_publish_nothing() -> None:
    fleet = FleetState()
    c = cycle(fleet)
    assert scored(PrecisePrefixCacheScorer(), req(), [ep("new", block_size=None)], c) == [0.0]
    assert best_cached_tokens(c) == {}
    # No tokenizer configured for the model: no token ids, so no claim about any endpoint.
    c = cycle(fleet)
    assert scored(PrecisePrefixCacheScorer(), req(None, "some text"), [ep("a")], c) == [0.0]
    match = c.get(PRECISE_PREFIX)
    assert match is not None
    assert match.tokens is None
    assert match.cached_tokens == {}
    assert best_cached_tokens(c) == {}


def test_text_prompts_are_tokenized_with_the_models_tokenizer() -> None:
    fleet = FleetState()
    fleet.states.get(TOKENIZERS).set_models({"tiny": str(BUNDLED_DIR)})
    text = "The quick brown fox jumps over the lazy dog. " * 20
    request = req(None, text)
    ids = fleet.states.get(TOKENIZERS).token_ids(request)
    assert ids is not None
    assert ids[0] == 0  # BOS, as vLLM adds for completions
    engine_stores(fleet, "a", tuple(ids), len(ids) // BS)
    assert scored(PrecisePrefixCacheScorer(), request, [ep("a")], cycle(fleet)) == [1.0]


def test_pick_adds_speculative_entries_until_the_ttl() -> None:
    fleet = FleetState()
    engine_stores(fleet, "a", PROMPT, 3)
    scorer = PrecisePrefixCacheScorer(PreciseParams(speculative_ttl=2.0))
    spec = ProfileSpec(
        "p",
        (
            PluginSpec("precise-prefix-cache-scorer", "precise", PreciseParams(), 1.0),
            PluginSpec("max-score-picker", "picker", MaxScoreParams(seed=1)),
        ),
    )
    first = build_profile(spec).run(req(), [ep("a"), ep("b")], cycle(fleet, now=100.0), 1)
    assert first.endpoints[0].address == "a"
    # Before the engine reports the prefill, the same prompt goes where the first one went.
    assert scored(scorer, req(), [ep("a"), ep("b")], cycle(fleet, now=101.0)) == [1.0, 0.0]
    assert scored(scorer, req(), [ep("a"), ep("b")], cycle(fleet, now=102.5)) == [0.3, 0.0]


def test_zero_ttl_disables_speculation() -> None:
    fleet = FleetState()
    scorer = PrecisePrefixCacheScorer(PreciseParams(speculative_ttl=0))
    c = cycle(fleet)
    scored(scorer, req(), [ep("a")], c)
    scorer.on_pick(req(), ep("a"), c)
    assert scored(scorer, req(), [ep("a")], cycle(fleet)) == [0.0]


def test_max_blocks_caps_the_work_on_huge_prompts() -> None:
    fleet = FleetState()
    engine_stores(fleet, "a", PROMPT, 2)
    scorer = PrecisePrefixCacheScorer(PreciseParams(max_blocks=4))
    assert scored(scorer, req(), [ep("a")], cycle(fleet)) == [0.5]


def test_token_ids_outside_the_vocabulary_range_match_nothing() -> None:
    fleet = FleetState()
    assert scored(PrecisePrefixCacheScorer(), req((-5,) * 32), [ep("a")], cycle(fleet)) == [0.0]


def test_lora_requests_match_their_adapters_blocks() -> None:
    fleet = FleetState()
    fleet.states.get(PRECISE_INDEX).stored(
        "a", [1, 2], None, PROMPT[:32], BS, lora="ad", extra_keys=[["ad"]] * 2
    )
    request = req()
    assert scored(PrecisePrefixCacheScorer(), request, [ep("a")], cycle(fleet)) == [0.0]
    request.lora = "ad"
    assert scored(PrecisePrefixCacheScorer(), request, [ep("a")], cycle(fleet)) == [0.2]


def long_text_request(words: int = 3000) -> InferenceRequest:
    rng = random.Random(words)
    prompt = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(words))
    return req(tokens=None, prompt=prompt)


async def test_prepare_waits_for_a_long_new_prompt_so_it_is_scored_precisely() -> None:
    fleet = FleetState()
    fleet.states.get(TOKENIZERS).set_models({"tiny": str(BUNDLED_DIR)})
    scorer = PrecisePrefixCacheScorer(PreciseParams(max_inline_chars=1000))
    request = long_text_request()
    reference = TokenizerRegistry()  # its own cache: the prompt stays new to the fleet's
    reference.set_models({"tiny": str(BUNDLED_DIR)})
    engine_ids = reference.token_ids(request, max_inline_chars=10**9)
    assert engine_ids is not None
    engine_stores(fleet, "a", tuple(engine_ids), 5)

    await scorer.prepare(request, fleet)
    c = cycle(fleet)
    assert scored(scorer, request, [ep("a"), ep("b")], c) == [5 / (len(engine_ids) // BS), 0.0]
    match = c.get(PRECISE_PREFIX)
    assert match is not None
    assert match.cached_tokens["a"] == 5 * BS


async def test_without_waiting_a_long_new_prompt_scores_zero_until_tokenized() -> None:
    fleet = FleetState()
    fleet.states.get(TOKENIZERS).set_models({"tiny": str(BUNDLED_DIR)})
    scorer = PrecisePrefixCacheScorer(PreciseParams(max_inline_chars=1000, tokenize_wait=0))
    request = long_text_request()
    await scorer.prepare(request, fleet)
    c = cycle(fleet)
    assert scored(scorer, request, [ep("a")], c) == [0.0]
    match = c.get(PRECISE_PREFIX)
    assert match is not None
    assert match.tokens is None


async def test_prepare_gives_up_after_tokenize_wait_and_the_work_goes_on() -> None:
    fleet = FleetState()
    fleet.states.get(TOKENIZERS).set_models({"tiny": str(BUNDLED_DIR)})
    scorer = PrecisePrefixCacheScorer(PreciseParams(max_inline_chars=1000, tokenize_wait=1e-6))
    request = long_text_request(words=60_000)
    await scorer.prepare(request, fleet)  # returns at once: far too short a wait
    assert fleet.states.get(TOKENIZERS).token_ids(request, 1000) is None
    for _ in range(500):
        if fleet.states.get(TOKENIZERS).token_ids(request, 1000) is not None:
            break
        await asyncio.sleep(0.01)
    assert fleet.states.get(TOKENIZERS).token_ids(request, 1000) is not None
