"""A request's engine token ids, computed locally the way vLLM computes them.

The precise prefix scorer matches token blocks, so it needs exactly the ids the engine will
cache. vLLM tokenizes with the model's Hugging Face tokenizer:

- completions (and embeddings): ``tokenizer(prompt, add_special_tokens=True)``: the tokenizer's
  post-processor frames the text (a BOS for Llama-style models). Token-id prompts are used as
  they are and need no tokenizer.
- chat (and responses): the chat template is rendered with jinja2 exactly as transformers'
  ``apply_chat_template(add_generation_prompt=True)`` does (:mod:`epp.prefix.chat_template`),
  and the text is tokenized WITHOUT special tokens (the template writes the BOS itself).

The template's input comes from :attr:`InferenceRequest.messages` (see
:meth:`epp.request.ChatMessage.template_content`: text parts joined as vLLM joins them). Fields
other than role and content (tool calls, names) are not kept, so conversations that use them may
match less. A conversation with image or other media parts gets no precise ids: a text-only
model's engine refuses it ("... is not a multimodal model", 400) and a multimodal one expands
placeholders into ids only its processor knows.

Cost: the Rust tokenizer's time grows with the prompt (a long one takes tens of milliseconds),
almost all in its pre-tokenizer regex, and ``encode`` holds the GIL (the event loop stalls for
the whole call). Three things keep that off the request path (:mod:`epp.prefix.token_cache`):

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
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from epp.prefix.chat_template import ChatTemplate, ChatTemplateUnavailable
from epp.prefix.token_cache import DEFAULT_CACHE_BYTES, TokenCache
from epp.request import InferenceRequest

log = logging.getLogger(__name__)

# A short stall of the event loop at most; longer uncached stretches go to the worker thread.
DEFAULT_MAX_INLINE_CHARS = 8192
# Chat renders kept for requests in flight between preparation and scoring.
RENDERED_KEPT = 64
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
