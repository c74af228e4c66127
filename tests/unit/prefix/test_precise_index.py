"""PreciseIndex: re-keying engine blocks, reference counts, speculative entries, bounds."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from epp.prefix.precise import ROOT_KEY, PreciseIndex, chain_keys, root_key

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4


def keys(tokens: list[int] = TOKENS, lora: str | None = None) -> list[int]:
    return chain_keys(tokens, BS, root_key(lora))


def store_prompt(index: PreciseIndex, endpoint: str, n_blocks: int, first_hash: int = 1) -> None:
    """Store the first ``n_blocks`` of TOKENS in one event, engine hashes first_hash.."""
    index.stored(
        endpoint, list(range(first_hash, first_hash + n_blocks)), None, TOKENS[: n_blocks * BS], BS
    )


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_chain_keys_name_a_block_and_everything_before_it() -> None:
    full = keys()
    assert len(full) == 8
    assert keys(TOKENS[:14]) == full[:3]  # the partial 4th block has no key
    changed = [*TOKENS[:4], 999, *TOKENS[5:]]
    assert keys(changed)[0] == full[0]
    assert all(a != b for a, b in zip(keys(changed)[1:], full[1:], strict=True))
    assert keys(lora="a")[0] != full[0] != keys(lora="b")[0]
    assert root_key(None) == ROOT_KEY
    with pytest.raises(OverflowError):
        chain_keys([-1] * BS, BS, ROOT_KEY)


def test_match_is_the_leading_run_per_endpoint() -> None:
    index = PreciseIndex()
    store_prompt(index, "a", 8)
    store_prompt(index, "b", 3, first_hash=100)
    assert index.match(keys(), ["a", "b", "c"], now=0.0) == {"a": 8, "b": 3, "c": 0}
    assert index.match(keys()[:2], ["a"], now=0.0) == {"a": 2}
    assert index.match([], ["a"], now=0.0) == {"a": 0}


def test_blocks_chained_through_parent_events_get_the_same_keys() -> None:
    """A prefill stores blocks in one event, decode adds one per event: same keys either way."""
    index = PreciseIndex()
    index.stored("a", [1, 2], None, TOKENS[:8], BS)
    index.stored("a", [3], 2, TOKENS[8:12], BS)
    index.stored("a", [4, 5], 3, TOKENS[12:20], BS)
    assert index.match(keys(), ["a"], now=0.0) == {"a": 5}


def test_unknown_parent_leaves_blocks_unkeyed() -> None:
    index = PreciseIndex()
    before = sample("epp_kv_unkeyed_blocks_total", endpoint="orphan")
    assert index.stored("orphan", [7, 8], 12345, TOKENS[4:12], BS) == 0
    assert index.block_count("orphan") == 0
    assert sample("epp_kv_unkeyed_blocks_total", endpoint="orphan") == before + 2


def test_duplicate_stores_are_reference_counted() -> None:
    """vLLM stores a cached hash again and removes once per physical block (fixtures README)."""
    index = PreciseIndex()
    store_prompt(index, "a", 2)
    index.stored("a", [2], 1, TOKENS[4:8], BS)  # block 2 re-stored: two physical copies
    index.removed("a", [2])
    assert index.match(keys(), ["a"], now=0.0) == {"a": 2}
    index.removed("a", [2])
    assert index.match(keys(), ["a"], now=0.0) == {"a": 1}
    index.removed("a", [2, 999])  # more removes than stores, unknown hashes: ignored
    assert index.match(keys(), ["a"], now=0.0) == {"a": 1}
    assert index.block_count("a") == 1


def test_distinct_engine_hashes_with_one_key_count_separately() -> None:
    """Two engine hashes for the same tokens (e.g. an adapter at two paths) share our key."""
    index = PreciseIndex()
    index.stored("a", [1], None, TOKENS[:4], BS)
    index.stored("a", [50], None, TOKENS[:4], BS)
    index.removed("a", [1])
    assert index.match(keys(), ["a"], now=0.0) == {"a": 1}
    index.removed("a", [50])
    assert index.match(keys(), ["a"], now=0.0) == {"a": 0}


def test_removes_on_one_endpoint_leave_others_alone() -> None:
    index = PreciseIndex()
    store_prompt(index, "a", 4)
    store_prompt(index, "b", 4)
    index.removed("a", [3, 4])
    assert index.match(keys(), ["a", "b"], now=0.0) == {"a": 2, "b": 4}
    index.drop("b")
    assert index.match(keys(), ["a", "b"], now=0.0) == {"a": 2, "b": 0}
    assert index.block_size("b") is None
    assert index.block_size("a") == BS


def test_lora_blocks_match_only_that_adapter() -> None:
    index = PreciseIndex()
    index.stored("a", [1, 2], None, TOKENS[:8], BS, lora="x", extra_keys=[["x"], ["x"]])
    assert index.match(keys(), ["a"], now=0.0) == {"a": 0}
    assert index.match(keys(lora="x"), ["a"], now=0.0) == {"a": 2}
    assert index.match(keys(lora="y"), ["a"], now=0.0) == {"a": 0}


def test_extra_keys_beyond_the_adapter_make_blocks_unmatchable() -> None:
    """A cache salt (or a multimodal hash) is in the engine hash: a plain prompt cannot hit."""
    index = PreciseIndex()
    index.stored("a", [1, 2], None, TOKENS[:8], BS, extra_keys=[None, ["salt"]])
    index.stored("a", [3], 2, TOKENS[8:12], BS, extra_keys=[None])
    assert index.match(keys(), ["a"], now=0.0) == {"a": 1}
    # Keys stay chained through the salted block: its child is found (unmatchable too).
    assert index.block_count("a") == 3


def test_inconsistent_store_is_rejected_without_changes() -> None:
    index = PreciseIndex()
    with pytest.raises(ValueError, match="token ids"):
        index.stored("a", [1, 2], None, TOKENS[:7], BS)
    assert index.block_count("a") == 0


def test_speculative_entries_count_until_ttl_then_expire() -> None:
    index = PreciseIndex()
    index.add_speculative("a", keys()[:3], expires_at=10.0)
    assert index.match(keys(), ["a", "b"], now=9.9) == {"a": 3, "b": 0}
    assert index.match(keys(), ["a"], now=10.0) == {"a": 0}
    index.expire(now=10.0)
    assert not index._speculative
    assert not index._expiries


def test_speculative_and_confirmed_blocks_join_into_one_run() -> None:
    index = PreciseIndex()
    store_prompt(index, "a", 2)
    index.add_speculative("a", keys()[2:5], expires_at=10.0)
    assert index.match(keys(), ["a"], now=5.0) == {"a": 5}


def test_engine_store_confirms_a_speculative_entry() -> None:
    """Once confirmed, the engine's remove is final even within the TTL."""
    index = PreciseIndex()
    index.add_speculative("a", keys()[:2], expires_at=10.0)
    store_prompt(index, "a", 2)
    assert not index._speculative
    index.removed("a", [2])
    assert index.match(keys(), ["a"], now=5.0) == {"a": 1}
    index.expire(now=11.0)  # the stale expiry record is a no-op
    assert index.match(keys(), ["a"], now=5.0) == {"a": 1}


def test_refreshed_speculative_entry_survives_its_first_expiry_record() -> None:
    index = PreciseIndex()
    index.add_speculative("a", keys()[:1], expires_at=10.0)
    index.add_speculative("a", keys()[:1], expires_at=20.0)
    index.expire(now=15.0)
    assert index.match(keys(), ["a"], now=15.0) == {"a": 1}


def test_drop_forgets_speculative_entries_too() -> None:
    index = PreciseIndex()
    index.add_speculative("a", keys()[:2], expires_at=10.0)
    index.add_speculative("b", keys()[:2], expires_at=10.0)
    index.drop("a")
    assert index.match(keys(), ["a", "b"], now=5.0) == {"a": 0, "b": 2}


def test_speculative_entries_are_capped() -> None:
    index = PreciseIndex(max_speculative=4)
    index.add_speculative("a", keys()[:3], expires_at=10.0)
    index.add_speculative("b", keys()[:3], expires_at=10.0)
    # The oldest two of a's entries went first.
    assert index.match(keys(), ["a", "b"], now=5.0) == {"a": 0, "b": 3}
    assert len(index._expiries) == 4


def test_an_endpoint_over_its_block_limit_is_dropped() -> None:
    index = PreciseIndex(max_blocks_per_endpoint=5)
    before = sample("epp_kv_index_resets_total", endpoint="big", reason="overflow")
    store_prompt(index, "big", 5)
    assert index.block_count("big") == 5
    index.stored("big", [6], 5, TOKENS[20:24], BS)
    assert index.block_count("big") == 0
    assert sample("epp_kv_index_resets_total", endpoint="big", reason="overflow") == before + 1
