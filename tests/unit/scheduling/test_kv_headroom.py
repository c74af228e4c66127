"""kv-headroom-filter: a long prompt avoids replicas whose KV cache cannot hold it."""

from __future__ import annotations

from collections.abc import Sequence

from epp.prefix.approximate import approx_prefix
from epp.prefix.hashing import BlockHasher
from epp.scheduling.filters.kv_headroom import KvHeadroomFilter
from epp.scheduling.scorers.prefix import PrefixParams
from epp.state import EndpointState
from epp.state.fleet import FleetState
from tests.unit.scheduling.common import cycle, ep, profile_of, req, text


def geometry(address: str, free_blocks: int, block_size: int = 16) -> EndpointState:
    """An endpoint whose KV cache has ``free_blocks`` of its 1000 usable blocks free."""
    usage = (1000 - free_blocks) / 1000
    # vLLM's usage is over num_gpu_blocks - 1 (its null block).
    return ep(address, kv_usage=usage, num_gpu_blocks=1001, block_size=block_size)


# 1600 characters: ~401 tokens, 26 blocks of 16 tokens.
PROMPT = text("long", 1600)


def addresses(endpoints: Sequence[EndpointState]) -> list[str]:
    return [e.address for e in endpoints]


def test_drops_endpoints_without_room_for_the_prompt() -> None:
    eps = [geometry("tight", 25), geometry("roomy", 26), geometry("big-blocks", 13, block_size=32)]
    kept = KvHeadroomFilter().filter(req(PROMPT), eps, cycle())
    assert addresses(kept) == ["roomy", "big-blocks"]


def test_keeps_everyone_when_nobody_has_room() -> None:
    eps = [geometry("a", 3), geometry("b", 5)]
    assert KvHeadroomFilter().filter(req(PROMPT), eps, cycle()) == eps


def test_keeps_endpoints_whose_cache_geometry_is_unknown() -> None:
    eps = [geometry("tight", 2), ep("unscraped", kv_usage=0.99), geometry("roomy", 100)]
    assert addresses(KvHeadroomFilter().filter(req(PROMPT), eps, cycle())) == [
        "unscraped",
        "roomy",
    ]


def test_cached_prefix_blocks_need_no_room() -> None:
    fleet = FleetState()
    hashes = BlockHasher().hashes(req(PROMPT))
    fleet.states.get(approx_prefix()).insert(
        "tight", hashes, capacity=1000
    )  # all 25 full blocks: 400 tokens
    eps = [geometry("tight", 1), geometry("roomy", 100), geometry("also-tight", 1)]
    c = cycle(fleet)
    # The cached tokens come from the profile's data step (here: the approximate prefix).
    profile_of(("prefix-cache-scorer", PrefixParams(), 0.0)).produce(req(PROMPT), eps, c)
    kept = KvHeadroomFilter().filter(req(PROMPT), eps, c)
    assert addresses(kept) == ["tight", "roomy"]


def test_short_prompts_pass() -> None:
    eps = [geometry("a", 30), geometry("b", 1)]
    assert KvHeadroomFilter().filter(req("x" * 60), eps, cycle()) == eps


def test_token_prompts_count_exact_tokens() -> None:
    eps = [geometry("exact", 4), geometry("short", 3)]
    kept = KvHeadroomFilter().filter(req(tokens=tuple(range(64))), eps, cycle())
    assert addresses(kept) == ["exact"]
