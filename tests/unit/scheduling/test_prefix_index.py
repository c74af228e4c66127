"""The approximate prefix index: per-endpoint LRUs of block hashes."""

from __future__ import annotations

from epp.prefix.approximate import ApproximatePrefixIndex


def test_match_counts_consecutive_leading_blocks_per_endpoint() -> None:
    index = ApproximatePrefixIndex()
    index.insert("a", [1, 2, 3, 4], capacity=100)
    index.insert("b", [1, 2], capacity=100)
    assert index.match([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert index.match([1, 2, 3, 4], ["a"]) == {"a": 4}
    assert index.match([9, 2, 3], ["a"]) == {"a": 0}
    assert index.match([], ["a"]) == {"a": 0}


def test_lru_evicts_the_oldest_prompt_tail_first() -> None:
    index = ApproximatePrefixIndex()
    index.insert("a", [1, 2, 3], capacity=4)
    index.insert("a", [10, 11], capacity=4)
    # One block over capacity: the oldest prompt loses its last block, not its first.
    assert index.size("a") == 4
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}
    assert index.match([10, 11], ["a"]) == {"a": 2}
    # Reusing a prefix makes it recent: the other prompt is evicted next, tail first.
    index.insert("a", [1, 2], capacity=4)
    index.insert("a", [20], capacity=4)
    assert index.match([10, 11], ["a"]) == {"a": 1}
    assert index.match([1, 2], ["a"]) == {"a": 2}
    assert index.match([20], ["a"]) == {"a": 1}


def test_binary_search_agrees_with_a_linear_scan() -> None:
    index = ApproximatePrefixIndex()
    chain = list(range(100, 160))
    for held in (0, 1, 2, 7, 31, 59, 60):
        index.forget("a")
        if held:
            index.insert("a", chain[:held], capacity=1000)
        assert index.match(chain, ["a"]) == {"a": held}


def test_capacity_shrinks_to_the_latest_value() -> None:
    index = ApproximatePrefixIndex()
    index.insert("a", list(range(10)), capacity=10)
    index.insert("a", [0], capacity=3)
    assert index.size("a") == 3
    assert index.match(list(range(10)), ["a"]) == {"a": 3}


def test_forget_drops_an_endpoint() -> None:
    index = ApproximatePrefixIndex()
    index.insert("a", [1, 2], capacity=10)
    index.insert("b", [1, 2], capacity=10)
    index.forget("a")
    index.forget("never-seen")
    assert index.match([1, 2], ["a", "b"]) == {"a": 0, "b": 2}


def test_recent_insertions_replay_on_another_index() -> None:
    """What a later Redis sync needs: ship local insertions, apply remote ones once."""
    local, remote = ApproximatePrefixIndex(), ApproximatePrefixIndex()
    local.insert("a", [1, 2, 3], capacity=10)
    local.insert("b", [7, 8], capacity=10)
    batch = local.take_recent()
    assert [i.endpoint for i in batch] == ["a", "b"]
    assert local.take_recent() == []
    remote.apply(batch)
    assert remote.match([1, 2, 3], ["a", "b"]) == {"a": 3, "b": 0}
    assert remote.match([7, 8], ["b"]) == {"b": 2}
    # Applied insertions are not shipped again (no echo between processes).
    assert remote.take_recent() == []


def test_recent_insertions_are_bounded_when_nobody_collects_them() -> None:
    index = ApproximatePrefixIndex(recent_limit=2)
    for n in range(5):
        index.insert("a", [n], capacity=10)
    assert [list(i.hashes) for i in index.take_recent()] == [[3], [4]]
