"""Which endpoint probably caches which prompt blocks, learned from epp's own routing.

Engines do not tell an approximate scorer what they cache; epp remembers where it sent each
prompt instead (GIE's approximate prefix index): after every pick the request's block hashes are
recorded for the chosen endpoint, in one LRU per endpoint sized like that endpoint's KV cache, so
blocks the engine has most likely evicted are forgotten in the same order.

Chain invariant: a request records its blocks last-to-first, so a block is always at least as
recent as every block after it in the same prompt, and eviction (oldest first) removes a
prompt's tail before its head, as vLLM does. An endpoint's cached blocks of any prompt are
therefore a leading run, and :meth:`ApproximatePrefixIndex.match` finds its length by binary
search: ~log2(256) = 8 lookups per endpoint instead of one per block.

Sharing between epp processes rides on :meth:`~ApproximatePrefixIndex.take_recent`
and :meth:`~ApproximatePrefixIndex.apply`: each process ships the insertions it made as
batches and applies the others', which keeps the invariant because an insertion is replayed
whole.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from epp.prefix.hashing import BlockHasher
from epp.state.registry import Replication, StateKey

# GIE's default LRU size per endpoint when its KV capacity is unknown: 500k tokens / 16.
DEFAULT_CAPACITY = 31_250
# Insertions kept for sharing when nobody collects them; the oldest are dropped beyond this.
RECENT_LIMIT = 4096


class Insertion(NamedTuple):
    """One pick's contribution to the index, as shipped between processes."""

    endpoint: str
    hashes: Sequence[int]
    capacity: int


class Learned(NamedTuple):
    """One insertion as a journal keeps it: ``hashes[new_from:]`` were not cached before
    ``owner`` recorded them."""

    endpoint: str
    hashes: Sequence[int]
    capacity: int
    new_from: int
    owner: ApproximatePrefixIndex

    def move(self, served: str, _now: float) -> None:
        """Record the insertion for ``served`` instead (a retry ended there)."""
        self.owner.retract(self)
        self.owner.insert(served, self.hashes, self.capacity)


class ApproximatePrefixIndex:
    """Per-endpoint LRUs of block hashes; kept in the fleet state under :func:`approx_prefix`."""

    def __init__(self, recent_limit: int = RECENT_LIMIT) -> None:
        # OrderedDict as an LRU set: oldest first, move_to_end on reuse, popitem(last=False).
        self._lrus: dict[str, OrderedDict[int, None]] = {}
        self._recent: deque[Insertion] = deque(maxlen=recent_limit)
        # While set (see epp.state.moves.Recording), insertions are also noted here as
        # Learned, so that a pick's insertion can be moved to the endpoint a retry ended on
        # (a list shared with the other journaled states, hence Any).
        self.journal: list[Any] | None = None

    def insert(self, endpoint: str, hashes: Sequence[int], capacity: int) -> None:
        """Record that ``endpoint`` now caches ``hashes`` (a prompt's chain, first block first).

        ``capacity`` is the endpoint's cache size in blocks; the LRU shrinks or grows to it.
        """
        known = self._leading(self._lrus.get(endpoint), hashes)
        if self.journal is not None:
            self.journal.append(Learned(endpoint, hashes, capacity, known, self))
        self._insert(endpoint, hashes, capacity, known)
        self._recent.append(Insertion(endpoint, hashes, capacity))

    def retract(self, learned: Learned) -> None:
        """Undo what ``learned`` added: its blocks that were new to the endpoint go again.

        They are the chain's tail (see the module docstring), so the invariant holds. Blocks
        the endpoint already had stay: its cache did not lose them. Local only: other
        processes that replayed the insertion keep it until their LRU evicts it.
        """
        lru = self._lrus.get(learned.endpoint)
        if lru is None:
            return
        for h in learned.hashes[learned.new_from :]:
            lru.pop(h, None)

    def apply(self, batch: Iterable[Insertion]) -> None:
        """Replay insertions made by other processes (not recorded again as recent)."""
        for endpoint, hashes, capacity in batch:
            self._insert(
                endpoint, hashes, capacity, self._leading(self._lrus.get(endpoint), hashes)
            )

    def recent_count(self) -> int:
        """Additions made here and not yet taken by :meth:`take_recent`."""
        return len(self._recent)

    def take_recent(self) -> list[Insertion]:
        """Hand over (and forget) the insertions made here since the last call."""
        batch = list(self._recent)
        self._recent.clear()
        return batch

    def match(self, hashes: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """For each endpoint, how many leading blocks of ``hashes`` it caches."""
        return {e: self._leading(self._lrus.get(e), hashes) for e in endpoints}

    def forget(self, endpoint: str) -> None:
        """Drop everything known about ``endpoint`` (removed, restarted, cache cleared)."""
        self._lrus.pop(endpoint, None)

    def size(self, endpoint: str) -> int:
        """Blocks currently remembered for ``endpoint``."""
        lru = self._lrus.get(endpoint)
        return 0 if lru is None else len(lru)

    def _insert(self, endpoint: str, hashes: Sequence[int], capacity: int, known: int) -> None:
        """``known``: :meth:`_leading` of ``hashes`` on the endpoint, before this insertion."""
        lru = self._lrus.get(endpoint)
        if lru is None:
            lru = self._lrus[endpoint] = OrderedDict()
        capacity = max(1, capacity)
        touch = lru.move_to_end
        # Last block first: the head of the chain ends up most recent (see module docstring).
        # Past the cached leading run each block is looked up (new ones are added)...
        for h in reversed(hashes[known:]):
            if h in lru:
                touch(h)
            else:
                lru[h] = None
        # ...and the run itself, cached by the invariant, is moved up by a C loop (for a
        # repeated prompt, its whole chain). Should a block of it be missing
        # after all, it is added where the lookup would have added it, and the loop goes on.
        run = reversed(hashes[:known])
        while True:
            try:
                deque(map(touch, run), maxlen=0)
                break
            except KeyError as missing:
                lru[missing.args[0]] = None
        while len(lru) > capacity:
            lru.popitem(last=False)

    @staticmethod
    def _leading(lru: OrderedDict[int, None] | None, hashes: Sequence[int]) -> int:
        if not lru or not hashes or hashes[0] not in lru:
            return 0
        # Invariant: hashes[:low] are all cached and hashes[high:] are not (high may be len).
        low, high = 1, len(hashes)
        if hashes[-1] in lru:
            return high
        high -= 1
        while low < high:
            mid = (low + high) // 2
            if hashes[mid] in lru:
                low = mid + 1
            else:
                high = mid
        return low


# The approximate prefix index's state name (one instance per hashing parameter set).
APPROX_PREFIX = "approx-prefix"
_DEFAULT_HASHER = BlockHasher()


@functools.cache
def approx_prefix(hasher: BlockHasher = _DEFAULT_HASHER) -> StateKey[ApproximatePrefixIndex]:
    """The approximate prefix index of prompts cut by ``hasher`` (the prefix scorer's state).

    Keyed by what changes a block hash's meaning (``block_chars``, ``block_size``; the model and
    adapter are in the hash itself, ``max_blocks`` only cuts the chain short). The default
    parameters keep the pick-stream tag ``prefix`` of the releases before keyed indexes, so a
    rolling upgrade of a group configured with them still shares its index.
    """
    params = (hasher.block_chars, hasher.block_size)
    default = (_DEFAULT_HASHER.block_chars, _DEFAULT_HASHER.block_size)
    return StateKey(
        APPROX_PREFIX,
        ApproximatePrefixIndex,
        params,
        moves=True,
        replicated=Replication(Insertion),
        tag="prefix" if params == default else "",
    )
