"""The approximate prefix index: per-endpoint LRUs of block hashes."""

from __future__ import annotations

import random

from epp.prefix.approximate import ApproximatePrefixIndex, Insertion


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


def _reference_order(lru: list[int], hashes: list[int], capacity: int) -> list[int]:
    """The LRU order an insertion must leave, by its definition: each block, last first,
    moved to the most recent end (added if new), then the oldest dropped down to capacity."""
    order = list(lru)
    for h in reversed(hashes):
        if h in order:
            order.remove(h)
        order.append(h)
    return order[max(0, len(order) - max(1, capacity)) :]


def test_insertion_order_equals_the_definition_even_when_the_invariant_is_broken() -> None:
    """Random chains sharing prefixes, small capacities, retractions, and blocks deleted from
    the middle of cached runs by hand (which the chain invariant says never happens): the
    LRU's order is always the one the definition gives."""
    rng = random.Random(5)
    index = ApproximatePrefixIndex()
    expected: list[int] = []
    stems = [[rng.getrandbits(64) for _ in range(12)] for _ in range(4)]
    for step in range(400):
        stem = rng.choice(stems)
        hashes = stem[: rng.randint(1, 12)] + [
            rng.getrandbits(64) for _ in range(rng.randint(0, 3))
        ]
        capacity = rng.choice((8, 20, 100))
        if step % 7 == 3 and expected:  # break the invariant: a block vanishes mid-run
            gone = rng.choice(expected)
            index._lrus["e"].pop(gone)
            expected.remove(gone)
        expected = _reference_order(expected, hashes, capacity)
        if step % 2:
            index.insert("e", hashes, capacity)
        else:
            index.apply([Insertion("e", hashes, capacity)])
        assert list(index._lrus["e"]) == expected
