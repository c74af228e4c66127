"""A request's engine token ids, computed locally the way vLLM computes them.

The precise prefix scorer matches token blocks, so it needs exactly the ids the engine will
cache. vLLM tokenizes with the model's Hugging Face tokenizer:

- completions (and embeddings): ``tokenizer(prompt, add_special_tokens=True)``: the tokenizer's
  post-processor frames the text (a BOS for Llama-style models). Token-id prompts are used as
  they are and need no tokenizer.
- chat (and responses): the chat template is rendered with jinja2 exactly as transformers'
  ``apply_chat_template(add_generation_prompt=True)`` does, and the text is tokenized WITHOUT
  special tokens (the template writes the BOS itself).

The template's input comes from :attr:`InferenceRequest.messages` (see
:meth:`epp.request.ChatMessage.template_content`: text parts joined as vLLM joins them). Fields
other than role and content (tool calls, names) are not kept, so conversations that use them may
match less. A conversation with image or other media parts gets no precise ids: a text-only
model's engine refuses it ("... is not a multimodal model", 400) and a multimodal one expands
placeholders into ids only its processor knows.

Cost: the Rust tokenizer's time grows with the prompt (a long one takes tens of milliseconds),
almost all in its pre-tokenizer regex, and ``encode`` holds the GIL (the event loop stalls for
the whole call). Three things keep that off the request path:

1. An LRU of recent texts and their ids: a repeated prompt costs a dict lookup.
2. Prefix reuse: a new text that shares a long prefix with a cached one (the next chat turn,
   another question after the same system prompt or document) reuses the cached ids up to a
   *restart point* and tokenizes only the rest. Restart points (every ~1 KiB) are token starts
   that begin a pre-token ("word"); the tokenizer never merges across those, so encoding from
   one gives the same ids as encoding the whole text. That holds for pre-tokenizers that split
   locally (byte-level BPE: GPT-2, Llama 3, Qwen, ...) but not for ones that prepend a marker
   to the first word (SentencePiece-style Metaspace), so every reuse is verified: the ids of
   the stretch up to the next restart point must come out the same; if they do not, reuse is
   switched off for that tokenizer (logged once) and texts are tokenized whole.
3. Long uncached stretches (more than ``max_inline_chars``) are tokenized in a worker thread
   with ``encode_batch``, which releases the GIL. :meth:`TokenizerRegistry.wait_for` lets the
   request await that work before scheduling (the precise scorer bounds the wait); a request
   that stops waiting is scored without precise ids and the next one with that prefix finds
   them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from epp.request import ChatMessage, InferenceRequest

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# A short stall of the event loop at most; longer uncached stretches go to the worker thread.
DEFAULT_MAX_INLINE_CHARS = 8192
# Chat renders kept for requests in flight between preparation and scoring.
RENDERED_KEPT = 64
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
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerRegistry:
    """Model name -> its tokenizer; in the fleet state under :data:`~epp.prefix.precise.TOKENIZERS`.

    Tokenizers are loaded once per directory when a configuration names them and kept across
    reloads (with their caches) while some model still names the directory.
    """

    def __init__(self, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.cache_bytes = cache_bytes
        self._dirs: dict[str, str | None] = {}
        self._loaded: dict[str, ModelTokenizer | None] = {}
        self._warned: set[str] = set()
        self._executor: ThreadPoolExecutor | None = None

    def set_models(self, tokenizers: Mapping[str, str | None]) -> None:
        """Use ``tokenizers`` (model name -> tokenizer directory or None) from now on.

        New directories are loaded now (a configuration load, not a request, pays for it);
        a directory that fails to load leaves its models without precise prefix scoring.
        """
        self._dirs = dict(tokenizers)
        wanted = {d for d in self._dirs.values() if d is not None}
        self._loaded = {d: t for d, t in self._loaded.items() if d in wanted}
        for directory in wanted - self._loaded.keys():
            try:
                self._loaded[directory] = ModelTokenizer(Path(directory), self.cache_bytes)
            except Exception as exc:
                log.error("cannot load tokenizer %s: %s", directory, exc)
                self._loaded[directory] = None

    def token_ids(
        self, request: InferenceRequest, max_inline_chars: int = DEFAULT_MAX_INLINE_CHARS
    ) -> Sequence[int] | None:
        """The ids the engine will see for ``request``'s prompt, or None if not known now.

        None when the model has no usable tokenizer (logged once per model), the chat template
        cannot render the conversation, or the prompt is being tokenized in the background.
        """
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        directory = self._dirs.get(request.model)
        tokenizer = None if directory is None else self._loaded.get(directory)
        if tokenizer is None:
            self._warn_once(
                request.model,
                "model %r has no usable tokenizer (models.%s.tokenizer): the precise prefix "
                "scorer gives it 0",
                request.model,
                request.model,
            )
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="epp-tokenize")
        try:
            return tokenizer.token_ids(request, max_inline_chars, self._executor)
        except ChatTemplateUnavailable as exc:
            self._warn_once(f"{directory}\x00template", "%s: %s", directory, exc)
        # Scoring must never fail a request: text the tokenizer refuses (lone surrogates from
        # JSON escapes) just goes without a precise score.
        except Exception as exc:
            self._warn_once(f"{directory}\x00error", "%s: tokenizing failed: %r", directory, exc)
        return None

    async def wait_for(self, request: InferenceRequest, max_inline_chars: int) -> None:
        """Return once :meth:`token_ids` can answer ``request`` from the cache (or never
        will): a long prompt's tokenization starts in the worker thread and this waits for it
        while the event loop serves other streams. Callers bound the wait (``asyncio.timeout``);
        a cancelled wait leaves the work running, for the next request with that prompt."""
        if self.token_ids(request, max_inline_chars) is not None:
            return
        directory = self._dirs.get(request.model)
        tokenizer = None if directory is None else self._loaded.get(directory)
        text = None if tokenizer is None else tokenizer.text(request)
        work = None if text is None or tokenizer is None else tokenizer.cache.pending(text)
        if work is not None:
            await asyncio.shield(asyncio.wrap_future(work))

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


class ChatTemplateUnavailable(RuntimeError):
    """The tokenizer directory has no chat template, or jinja2 is not installed."""


class ModelTokenizer:
    """One tokenizer directory: its tokenizer, chat template, framing and token cache."""

    def __init__(self, directory: Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.directory = directory
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        self.special_tokens = _special_tokens(
            {**_read_json(directory / "special_tokens_map.json"), **config}
        )
        self._template_source = _template_source(directory, config)
        self._template: ChatTemplate | None = None
        self._template_error: str | None = None
        self.head, self.tail = _framing(self.tokenizer)
        self.cache = TokenCache(self.tokenizer, cache_bytes)
        # id(request) -> (request, rendered chat text); the request is kept to rule out id reuse.
        self._rendered: OrderedDict[int, tuple[InferenceRequest, str | None]] = OrderedDict()

    def token_ids(
        self, request: InferenceRequest, max_inline_chars: int, executor: ThreadPoolExecutor
    ) -> Sequence[int] | None:
        text = self.text(request)
        if text is None:
            return None
        ids = self.cache.encode(text, max_inline_chars, executor)
        if ids is None or request.api in ("chat", "responses") or not (self.head or self.tail):
            return ids
        return self.head + ids + self.tail

    def text(self, request: InferenceRequest) -> str | None:
        """The text the engine tokenizes for ``request`` (chat: the rendered template).

        A request is asked about twice (preparation, then scoring) and a long conversation
        costs a template render each time, so the last few renders are kept, keyed by request
        object.
        """
        if request.api not in ("chat", "responses"):
            return request.prompt
        kept = self._rendered.get(id(request))
        if kept is not None and kept[0] is request:
            return kept[1]
        template = self.chat_template()
        text: str | None = None
        try:
            if all(m.text_only for m in request.messages):
                text = template.render(request.messages)
        # The template rejected the conversation (raise_exception, a missing field): the
        # engine will answer 400, and there is nothing to match.
        except Exception as exc:
            log.debug("chat template failed for request %s: %s", request.request_id, exc)
        self._rendered[id(request)] = (request, text)
        if len(self._rendered) > RENDERED_KEPT:
            self._rendered.popitem(last=False)
        return text

    def chat_template(self) -> ChatTemplate:
        """The compiled chat template (compiled on first use: completions-only fleets need none)."""
        if self._template is not None:
            return self._template
        if self._template_error is None:
            try:
                if self._template_source is None:
                    raise ChatTemplateUnavailable("no chat template in tokenizer_config.json")
                self._template = ChatTemplate(self._template_source, self.special_tokens)
                return self._template
            except ChatTemplateUnavailable as exc:
                self._template_error = str(exc)
            except Exception as exc:  # a template jinja2 cannot compile
                self._template_error = f"chat template does not compile: {exc}"
        raise ChatTemplateUnavailable(self._template_error)


class ChatTemplate:
    """A chat template rendered with transformers' ``apply_chat_template`` semantics.

    Same jinja2 environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls,
    ``{% generation %}`` blocks, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
    non-ASCII text) and the same variables (``messages``, ``add_generation_prompt=True``, the
    special tokens). Message content is a string, or a list of text parts when the template
    iterates over the content, which is how vLLM's "auto" content format decides.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        env = _environment()
        self._template = env.from_string(source)
        self.content_as_parts = _iterates_over_content(env.parse(source))
        self._variables = dict(special_tokens)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        return str(
            self._template.render(
                messages=[
                    {"role": m.role, "content": m.template_content(self.content_as_parts)}
                    for m in messages
                ],
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self._variables,
            )
        )


def _environment() -> Any:
    """transformers' chat-template environment. jinja2 is imported here, not at module load,
    so that completions-only deployments work without it."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateUnavailable(
            "jinja2 is not installed: chat prompts cannot be rendered"
        ) from None

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering is unaffected, so the block renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _iterates_over_content(ast: Any) -> bool:
    """True if the template loops over a message's content (directly or through a variable)."""
    from jinja2 import nodes

    def is_content(node: Any) -> bool:
        while isinstance(node, nodes.Filter | nodes.Test):
            node = node.node
        return (isinstance(node, nodes.Getattr) and node.attr == "content") or (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == "content"
        )

    aliases = {
        a.target.name
        for a in ast.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and is_content(a.node)
    }
    for loop in ast.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter):
            target = target.node
        if is_content(target) or (isinstance(target, nodes.Name) and target.name in aliases):
            return True
    return False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> Any:
    """Special tokens are strings or serialized AddedTokens (``{"content": ...}``)."""
    return value.get("content") if isinstance(value, dict) else value


def _special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    tokens: dict[str, Any] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = _token_text(config.get(name))
        if isinstance(value, str):
            tokens[name] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [_token_text(t) for t in extra]
    return tokens


def _template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja`` or ``tokenizer_config.json``'s."""
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _framing(tokenizer: Tokenizer) -> tuple[array[int], array[int]]:
    """Ids the post-processor puts before and after a text's own (e.g. BOS), found by probing."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    framed = tokenizer.encode("a", add_special_tokens=True).ids
    for i in range(len(framed) - len(plain) + 1):
        if framed[i : i + len(plain)] == plain:
            return array("I", framed[:i]), array("I", framed[i + len(plain) :])
    raise ValueError("the tokenizer's post-processor rewrites the text's own tokens")


# -- the token cache -------------------------------------------------------------------------


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
