"""Text -> token ids with prefix reuse (:class:`TokenCache`): an LRU of tokenized texts, each
with its restart points, so that a text sharing a long prefix with a cached one is tokenized
only from the last restart point before they diverge (verified, see :mod:`epp.prefix.tokens`),
and long stretches are tokenized in a worker thread."""

from __future__ import annotations

import logging
import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tokenizers import Encoding, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# Spacing of restart points: reuse gives up at most this much of a shared prefix.
RESTART_SPACING = 1024
# A restart point used for reuse must end this far before the texts diverge: pre-tokenizer
# regexes look ahead a character or two, never this far.
MARGIN_CHARS = 64
# Texts are indexed for prefix reuse under their first N characters, for these N (deepest
# first at lookup, so a conversation finds its own previous turn before another user's turn
# that shares only the system prompt).
ANCHOR_LEVELS = (256, 1024, 4096, 16384, 65536, 262144)
CANDIDATES_PER_ANCHOR = 8
# Background tokenizations queued at most; beyond, requests go without precise scoring.
MAX_PENDING = 16
# A word longer than this many tokens yields no restart point (the walk back is bounded).
_MAX_WORD_TOKENS = 64


@dataclass(slots=True)
class _Entry:
    """A tokenized text and its restart points (ascending char offsets, token indexes)."""

    text: str
    ids: array[int]
    points_chars: array[int]
    points_tokens: array[int]

    def size(self) -> int:
        ids, chars, tokens = self.ids, self.points_chars, self.points_tokens
        return sys.getsizeof(self.text) + 4 * (len(ids) + len(chars) + len(tokens)) + 256


@dataclass(frozen=True, slots=True)
class _Plan:
    """How to get a text's ids: cached as they are, or from ``base`` up to restart point
    ``cut`` then tokenizing from that point's character ``start``."""

    ids: array[int] | None = None
    base: _Entry | None = None
    cut: int = 0
    start: int = 0


class TokenCache:
    """Text -> token ids (no special tokens), with prefix reuse; safe across threads."""

    def __init__(self, tokenizer: Tokenizer, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.reuse = True
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # (level, hash of the text's first `level` chars) -> texts, most recent last.
        self._anchors: dict[tuple[int, int], list[str]] = {}
        self._bytes = 0
        # Text -> its background tokenization, for callers that would rather wait for it.
        self._pending: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    def encode(
        self, text: str, max_inline_chars: int, executor: ThreadPoolExecutor
    ) -> array[int] | None:
        """Ids of ``text`` now if cached or cheap enough, else None (and tokenize it later)."""
        plan = self.plan(text)
        if plan.ids is not None:
            return plan.ids
        if len(text) - plan.start <= max_inline_chars:
            return self.complete(text, plan)
        with self._lock:
            if text in self._pending or len(self._pending) >= MAX_PENDING:
                return None
            self._pending[text] = executor.submit(self._complete_later, text)
        return None

    def pending(self, text: str) -> Future[None] | None:
        """The background tokenization of ``text``, if one is queued or running."""
        with self._lock:
            return self._pending.get(text)

    def plan(self, text: str) -> _Plan:
        with self._lock:
            entry = self._entries.get(text)
            if entry is not None:
                self._entries.move_to_end(text)
                return _Plan(ids=entry.ids)
            if not self.reuse:
                return _Plan()
            base, shared = self._longest_shared_prefix(text)
            if base is None:
                return _Plan()
            # The restart point before the last one inside the shared prefix: the stretch
            # between the two is what verifies that tokenizing from the first is exact.
            cut = bisect_right(base.points_chars, shared - MARGIN_CHARS) - 2
            if cut < 0:
                return _Plan()
            return _Plan(base=base, cut=cut, start=base.points_chars[cut])

    def complete(self, text: str, plan: _Plan) -> array[int]:
        """Tokenize what ``plan`` leaves to do and cache the result. Releases the GIL."""
        base = plan.base
        if base is None:
            encoding = self._encode(text)
            ids = array("I", encoding.ids)
            chars, tokens = _restart_points(encoding, len(text), 0, 0)
        else:
            k = base.points_tokens[plan.cut]
            encoding = self._encode(text[plan.start :])
            suffix = encoding.ids
            if not self._verified(base, plan, encoding):
                return self.complete(text, _Plan())
            ids = base.ids[:k] + array("I", suffix)
            chars, tokens = _restart_points(encoding, len(text) - plan.start, plan.start, k)
            chars = base.points_chars[: plan.cut + 1] + chars
            tokens = base.points_tokens[: plan.cut + 1] + tokens
        self._insert(_Entry(text, ids, chars, tokens))
        return ids

    def _encode(self, text: str) -> Encoding:
        # encode_batch releases the GIL (encode does not), so a worker thread does not stall
        # the event loop.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0]

    def _verified(self, base: _Entry, plan: _Plan, suffix: Encoding) -> bool:
        start, k = base.points_chars[plan.cut], base.points_tokens[plan.cut]
        end, k_end = base.points_chars[plan.cut + 1], base.points_tokens[plan.cut + 1]
        same = (
            suffix.ids[: k_end - k] == base.ids[k:k_end].tolist()
            and suffix.char_to_token(end - start) == k_end - k
        )
        if not same and self.reuse:
            self.reuse = False
            log.warning(
                "tokenizing from a word boundary does not reproduce whole-text tokens for "
                "this tokenizer; prefix reuse is off for it (long prompts cost more)"
            )
        return same

    def _complete_later(self, text: str) -> None:
        try:
            self.complete(text, self.plan(text))
        except Exception:
            log.exception("background tokenization failed")
        finally:
            with self._lock:
                self._pending.pop(text, None)

    def _longest_shared_prefix(self, text: str) -> tuple[_Entry | None, int]:
        for level in reversed(ANCHOR_LEVELS):
            if level > len(text):
                continue
            candidates = self._anchors.get((level, hash(text[:level])))
            if not candidates:
                continue
            best, shared = None, 0
            for candidate in candidates:
                n = _common_prefix(text, candidate)
                if n > shared:
                    best, shared = candidate, n
            return (self._entries[best], shared) if best is not None else (None, 0)
        return None, 0

    def _insert(self, entry: _Entry) -> None:
        size = entry.size()
        if size > self.max_bytes:
            return
        with self._lock:
            if entry.text in self._entries:
                return
            self._entries[entry.text] = entry
            self._bytes += size
            for level in ANCHOR_LEVELS:
                if level > len(entry.text):
                    break
                texts = self._anchors.setdefault((level, hash(entry.text[:level])), [])
                texts.append(entry.text)
                if len(texts) > CANDIDATES_PER_ANCHOR:
                    del texts[0]
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.size()
                self._unanchor(old.text)

    def _unanchor(self, text: str) -> None:
        for level in ANCHOR_LEVELS:
            if level > len(text):
                break
            key = (level, hash(text[:level]))
            texts = self._anchors.get(key)
            if texts is None:
                continue
            # Texts are compared by identity: an equal text inserted again is another entry.
            texts[:] = [t for t in texts if t is not text]
            if not texts:
                del self._anchors[key]


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by binary search over slice comparisons (memcmp speed)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _restart_points(
    encoding: Encoding, length: int, char_base: int, token_base: int
) -> tuple[array[int], array[int]]:
    """Token starts that begin a word, about every ``RESTART_SPACING`` characters."""
    chars, tokens = array("I"), array("I")
    for position in range(RESTART_SPACING, length, RESTART_SPACING):
        k = encoding.char_to_token(position)
        if k is None:
            continue
        word = encoding.token_to_word(k)
        if word is None:
            continue
        first = k
        while first > 0 and k - first < _MAX_WORD_TOKENS:
            if encoding.token_to_word(first - 1) != word:
                break
            first -= 1
        if first > 0 and encoding.token_to_word(first - 1) == word:
            continue  # a very long word: no restart point in it
        span = encoding.token_to_chars(first)
        if span is None or (chars and span[0] + char_base <= chars[-1]):
            continue
        chars.append(span[0] + char_base)
        tokens.append(first + token_base)
    return chars, tokens
