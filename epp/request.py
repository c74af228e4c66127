"""Turn an OpenAI HTTP request into the :class:`InferenceRequest` scheduling works on.

Parsing is strict about types (a wrongly typed field is a 400 naming the field, never a silent
wrong route) and lenient about fields it does not need (they pass through to the engine).
The prompt text extracted here is what prefix scorers hash, so its construction matters: for
chat the conversation is laid out message by message in order, so that a later turn's text
starts with exactly the text of the earlier turns and matches their cached blocks.

Chat and responses conversations are kept structured (:class:`ChatMessage`: a role and typed
content parts). Both the text prefix scorers hash (:func:`hashing_text`) and the chat template's
input (:meth:`ChatMessage.template_content`) are derived from that structure here, with every
separator declared once below, so they cannot drift apart or from the engine's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, AnyStr, Literal

import msgspec

from epp import wire
from epp.errors import (
    RequestError,
    bad_request,
    body_too_large,
    model_not_found,
    unknown_path,
    unsupported_media_type,
)

Api = Literal["completions", "chat", "responses", "embeddings"]

# A session header longer than this is refused (400): ids are UUIDs or short tokens, and a
# longer one would be forwarded to the replica, which may refuse it less clearly.
MAX_SESSION_BYTES = 1024
# Sessions are kept, and shipped to the other epps, as this many bytes of BLAKE2b of the
# header (in hex): a table entry and a picks-stream item have the same size whatever was sent.
SESSION_DIGEST_BYTES = 16

# The OpenAI paths epp routes, matched exactly (the query string aside): a path that only ends
# like one (``/v1/../admin/../v1/chat/completions``, ``/x/v1/completions``, a trailing slash)
# is refused rather than forwarded as sent, where a replica or a proxy that normalises it might
# serve whatever it points at. Envoy normalises paths before epp sees them (docs/deploy.md).
_API_BY_PATH: Mapping[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
}

# vLLM generates up to the context length when a chat request names no limit; assume a typical
# answer length for load accounting rather than the worst case.
DEFAULT_OUTPUT_TOKENS = 256
# Characters per token of English text under common BPE tokenizers, for estimates only.
CHARS_PER_TOKEN = 4

# vLLM joins the non-empty text parts of one message with a newline before rendering a template
# that takes string content (vllm/entrypoints/chat_utils.py, ``"\n".join(texts)``). Token ids
# epp derives for multi-part content match the engine's only with the same rule.
TEXT_PART_SEPARATOR = "\n"
# Separators that cannot appear in ordinary text keep "role + content" boundaries unambiguous
# in the hashing text; a media part is marked so that its reference never equals a text part.
ROLE_SEPARATOR = "\x1f"
MESSAGE_SEPARATOR = "\x1e"
MEDIA_MARK = "\x1d"

PartKind = Literal["text", "image", "other"]
# Content part types vLLM reads as text, and the key each keeps its text under.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
}
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a message's content: text, an image, or other media (audio, video, file).

    ``value`` is the text of a text part, and for media a stable reference to it (its URL, or
    the part as canonical JSON) so that two different images never hash alike.
    """

    kind: PartKind
    value: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """A chat message as the engine's chat handling sees it: a role and its content parts."""

    role: str
    parts: tuple[ContentPart, ...]

    @property
    def text_only(self) -> bool:
        return all(p.kind == "text" for p in self.parts)

    def text(self) -> str:
        """The content as the engine passes it to a template that takes strings (empty text
        parts dropped, as vLLM drops them before joining)."""
        return TEXT_PART_SEPARATOR.join(p.value for p in self.parts if p.kind == "text" and p.value)

    def template_content(self, as_parts: bool) -> str | list[dict[str, str]]:
        """The ``content`` a chat template sees: a string, or (for templates that iterate over
        content, vLLM's "openai" content format) the list of text parts."""
        if as_parts:
            return [{"type": "text", "text": p.value} for p in self.parts if p.kind == "text"]
        return self.text()


def hashing_text(messages: Sequence[ChatMessage]) -> str:
    """The conversation laid out for prefix hashing: each message's role, then its parts in
    order (text as it is, media as a marked reference), so a later turn extends an earlier one."""
    return "".join(
        message.role
        + ROLE_SEPARATOR
        + TEXT_PART_SEPARATOR.join(
            p.value if p.kind == "text" else f"{MEDIA_MARK}{p.kind}:{p.value}{MEDIA_MARK}"
            for p in message.parts
            if p.value or p.kind != "text"
        )
        + MESSAGE_SEPARATOR
        for message in messages
    )


@dataclass(frozen=True, slots=True)
class LatencyTarget:
    """A request's latency targets in seconds: time to first token and time per output token
    (None: no target of that kind)."""

    ttft: float | None = None
    tpot: float | None = None

    def __bool__(self) -> bool:
        return self.ttft is not None or self.tpot is not None

    def met(self, ttft: float, tpot: float) -> bool:
        """Whether a response with this TTFT and TPOT (predicted or measured) meets it."""
        return (self.ttft is None or ttft <= self.ttft) and (self.tpot is None or tpot <= self.tpot)

    def headroom_used(self, ttft: float, tpot: float) -> float:
        """The tightest of the targets' fractions used (1: just met), for preferring the
        endpoint that meets the targets with the least speed to spare."""
        used = [v / t for v, t in ((ttft, self.ttft), (tpot, self.tpot)) if t is not None]
        return max(used, default=0.0)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """Who a bearer API key belongs to: its fairness id and (optionally) its objective."""

    tenant: str
    objective: str | None = None


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """Which headers carry priority, objective, fairness id and session, how objectives map to
    priorities, and which of those sources are trusted (docs/identity.md).

    Nothing a client sends is trusted by default. A request whose ``authorization: Bearer KEY``
    is in ``api_keys`` gets that key's tenant and objective whatever its headers say. Else a
    header is read only when the configuration names who sets it: every identity and SLO header
    when ``trusted_headers`` says a gateway in front sets them all (overwriting client copies),
    or the ``authenticated_headers`` an authenticating filter of the rendered Envoy sets (JWT
    claims, an external authorization service) after Envoy stripped the client's copies.
    Anything else gets the default objective and flow.
    """

    session_header: str = wire.SESSION_HEADER
    priority_header: str = wire.PRIORITY_HEADER
    objective_header: str = wire.OBJECTIVE_HEADER
    fairness_header: str = wire.FAIRNESS_HEADER
    objectives: Mapping[str, int] = field(default_factory=dict)
    # Objectives whose requests may go to an overflow pool (docs/admission.md, spillover).
    spill_objectives: frozenset[str] = frozenset()
    # Latency targets of objectives that have them (objectives.NAME.ttft_ms / tpot_ms).
    objective_targets: Mapping[str, LatencyTarget] = field(default_factory=dict)
    trusted_headers: bool = False
    authenticated_headers: frozenset[str] = frozenset()
    api_keys: Mapping[str, ApiKey] = field(default_factory=dict)
    # Write the request's priority into the forwarded body as vLLM's ``priority`` field (for
    # engines run with ``--scheduling-policy priority``; docs/admission.md, engine priority).
    engine_priority: bool = False

    def trusts(self, header: str) -> bool:
        """Whether header ``header``'s value comes from a trusted source, not the client."""
        return self.trusted_headers or header in self.authenticated_headers

    def identity_headers(self) -> tuple[str, ...]:
        """Every header that names a priority, objective, tenant or latency target: the ones
        Envoy strips from clients unless the configuration trusts them."""
        return (
            self.priority_header,
            self.objective_header,
            self.fairness_header,
            wire.SLO_TTFT_HEADER,
            wire.SLO_TPOT_HEADER,
        )


@dataclass(slots=True)
class InferenceRequest:
    """What scheduling needs to know about one request."""

    request_id: str
    path: str
    api: Api
    model: str
    # The text prefix scorers hash (for chat and responses: :func:`hashing_text` of messages).
    prompt: str
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    stream: bool = False
    priority: int = 0
    # The flow it shares its band's dispatches with (tenant); one flow unless identified.
    fairness_id: str = wire.DEFAULT_FLOW
    # The configured objective it was given by a trusted source ('' for none).
    objective: str = ""
    session: str | None = None
    # The LoRA adapter the request runs on (set by the router from the model's configuration).
    lora: str | None = None
    body_size: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)
    # The conversation, for chat and responses requests (empty for the others).
    messages: tuple[ChatMessage, ...] = ()

    def prompt_tokens(self) -> int:
        """Prompt length in tokens: exact for token prompts, estimated from characters else."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return len(self.prompt) // CHARS_PER_TOKEN + 1

    def output_tokens(self) -> int:
        """The output it may generate: ``max_tokens``, or a typical length when absent."""
        return DEFAULT_OUTPUT_TOKENS if self.max_tokens is None else self.max_tokens

    def expected_tokens(self, cached: int = 0) -> int:
        """The work this request puts on an engine: the prompt tokens it must compute (all
        but the ``cached`` ones, which the engine reuses) plus the output it may generate."""
        return max(0, self.prompt_tokens() - cached) + self.output_tokens()


def api_for_path(path: str) -> Api | None:
    """The OpenAI API a path addresses: the path without its query string, exactly."""
    return _API_BY_PATH.get(path.partition("?")[0])


def parse_request(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    policy: RequestPolicy,
    models: Collection[str] | None = None,
) -> InferenceRequest:
    """:func:`parse_decoded` without the decoded body."""
    return parse_decoded(path, headers, body, policy, models)[0]


def parse_decoded(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    policy: RequestPolicy,
    models: Collection[str] | None = None,
) -> tuple[InferenceRequest, dict[str, Any]]:
    """Parse an OpenAI request body (returned decoded too, so that nothing decodes it twice);
    raise :class:`~epp.errors.RequestError` if malformed (400) or, when ``models`` are given,
    if it names none of them (404).

    The model is checked before the rest of the body, as OpenAI does (an unknown model is 404
    ``model_not_found`` whatever else the body lacks): the model decides where a request could
    go and which API fields its engine would want, so it is the first thing to get right.
    """
    api = api_for_path(path)
    if api is None:
        raise unknown_path(headers.get(":method", "POST"), path)
    data = load_body(body)

    model = data.get("model")
    if model is None:
        raise bad_request("Missing required field 'model'.", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("Field 'model' must be a non-empty string.", "model")
    if models is not None and model not in models:
        raise model_not_found(model, list(models))

    try:
        prompt, token_ids, messages = _PROMPT_READERS[api](data)
    except RecursionError:
        raise too_deep() from None
    _check_encodable(prompt)
    priority, fairness_id, objective = _identity(headers, policy)
    request = InferenceRequest(
        request_id=headers.get(wire.REQUEST_ID) or os.urandom(12).hex(),
        path=path,
        api=api,
        model=model,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=token_ids,
        max_tokens=_max_tokens(api, data),
        stream=_optional(data, "stream", bool) or False,
        priority=priority,
        fairness_id=fairness_id,
        objective=objective,
        session=_session(headers, policy.session_header),
        body_size=len(body),
        headers=headers,
    )
    return request, data


def set_engine_priority(request: InferenceRequest, data: dict[str, Any]) -> bool:
    """Write the request's priority into the decoded body as vLLM's ``priority`` field; True
    when the body changed (and must be re-serialised).

    epp's priorities rank higher as more important, vLLM serves the lower value first: the
    field is the negated priority. Whatever the client put there is overwritten (priority comes
    from trusted sources only, :func:`_identity`), and vLLM's default of 0 needs no field.
    """
    wanted = -request.priority
    current = data.get("priority", 0)
    if type(current) is int and current == wanted:
        return False
    if wanted == 0:
        del data["priority"]
    else:
        data["priority"] = wanted
    return True


def check_headers(headers: Mapping[str, str], max_body_bytes: int) -> RequestError | None:
    """What the request headers alone show to be refused, answered before any body arrives
    (so a client that waits for ``100 Continue``, or reads while it sends, is spared the
    upload): a path that is no inference API (404), a declared body over the limit (413), a
    Content-Type that is not JSON (415). None when the headers are acceptable."""
    path = headers.get(":path", "")
    if api_for_path(path) is None:
        return unknown_path(headers.get(":method", "POST"), path)
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        return body_too_large(int(declared), max_body_bytes)
    content_type = headers.get("content-type")
    if content_type is not None and not _is_json_media_type(content_type):
        return unsupported_media_type(content_type)
    return None


def _is_json_media_type(value: str) -> bool:
    """``application/json`` or a ``+json`` type, parameters (charset) ignored. An absent
    Content-Type is accepted as JSON, as the engine (FastAPI) accepts it."""
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def load_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 naming what is wrong with it.

    Stricter than :func:`json.loads` where leniency would let epp and the engine read one body
    two ways, or let a body crash epp: duplicate keys anywhere (which of two ``model`` values
    routes?), ``NaN``/``Infinity`` and numbers that overflow to infinity (not JSON), nesting
    deeper than the interpreter's recursion limit (about 1000 levels: a 400, never a 500).
    Integers longer than Python's 4300-digit limit fail in the decoder itself.

    Decoded by msgspec first (5x the standard library on a 200 KB prompt, on par with orjson,
    which reads integers over 64 bits as floats): a body it accepts and that provably has no
    duplicate key (:func:`_decode_fast`) is done. Anything else, valid or not, goes through the
    standard library's strict decode, which is the reference and names what is wrong.
    """
    data = _decode_fast(body)
    return _decode_strict(body) if data is None else data


def _decode_fast(body: bytes) -> dict[str, Any] | None:
    """The body as msgspec decodes it, when that equals the strict decode; else None.

    msgspec refuses what the strict decode refuses except duplicate keys (it keeps the last)
    and lone surrogate escapes, which it refuses too. A duplicate is found by counting quotes:
    every ``"`` in JSON text delimits a string (a key or a value) or is an escaped quote
    inside one, so without duplicates the body holds exactly two per decoded string plus one
    per ``"`` inside the decoded strings; a dropped duplicate key adds at least two. A
    ``\\u0022`` escape yields a quote with no ``"`` in the text, so a body with one (and any
    quote in its strings) is left to the strict decode.
    """
    try:
        data = _FAST_DECODER.decode(body)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    strings, quotes = _tally_strings(data)
    if _count(body, b'"') != 2 * strings + quotes:
        return None
    if quotes and b"\\u0022" in body:
        return None
    return data


def _tally_strings(data: dict[str, Any]) -> tuple[int, int]:
    """Strings (keys and values) in a decoded document, and the quotes inside them."""
    strings = quotes = 0
    stack: list[Any] = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings += 1
            quotes += _count(item, '"')
        elif isinstance(item, dict):
            strings += len(item)
            quotes += _count("".join(item), '"')
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return strings, quotes


def _count(text: AnyStr, char: AnyStr) -> int:
    """``text.count(char)``, much faster when ``char`` is rare in a long text (a large prompt):
    ``find`` runs memchr, ``count`` compares every byte; many hits fall back to ``count``.
    Short texts (most keys and values, a 1 KB body) are counted at once: one C call costs less
    than a Python loop over their few hits."""
    if len(text) <= _COUNT_AT_ONCE:
        return text.count(char)
    found = 0
    at = text.find(char)
    while at >= 0:
        found += 1
        if found == _FIND_LIMIT:
            return found + text.count(char, at + 1)
        at = text.find(char, at + 1)
    return found


_FIND_LIMIT = 32
# Up to this length one ``count`` call costs less than ``find`` calls, whatever the hits.
_COUNT_AT_ONCE = 2048


def _decode_strict(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(
            body,
            object_pairs_hook=_unique_keys,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except RecursionError:
        raise too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise bad_request(f"Request body must be a JSON object, got {_json_kind(data)}.")
    return data


_FAST_DECODER = msgspec.json.Decoder()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        counts = Counter(k for k, _ in pairs)
        duplicate = next(k for k, n in counts.items() if n > 1)
        raise ValueError(f"duplicate key '{duplicate}' in an object")
    return data


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"'{name}' is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def too_deep() -> RequestError:
    return bad_request(
        "Request body nests arrays or objects too deeply (about 1000 levels is the limit)."
    )


def _check_encodable(text: str) -> None:
    """The prompt text epp hashes must be valid Unicode: a ``\\ud800`` escape decodes to a
    lone surrogate, which no UTF-8 encoder (epp's hashing, the engine's tokenizer) accepts."""
    if text.isascii():  # a flag of the string: no scan, no copy
        return
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"Request text contains a lone UTF-16 surrogate ({text[exc.start]!a}); "
            "escape characters outside the BMP as a surrogate pair."
        ) from None


def _optional(data: Mapping[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    # bool is a subclass of int; a JSON true is not a token count.
    if value is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return value
    raise bad_request(f"Field '{key}' must be of type {_TYPE_NAMES[kind]}.", key)


_TYPE_NAMES = {bool: "boolean", int: "integer", str: "string", list: "array"}


def _max_tokens(api: Api, data: Mapping[str, Any]) -> int | None:
    keys = {
        "completions": ("max_tokens",),
        "chat": ("max_completion_tokens", "max_tokens"),
        "responses": ("max_output_tokens",),
        "embeddings": (),
    }[api]
    for key in keys:
        value: int | None = _optional(data, key, int)
        if value is not None:
            if value < 0:
                raise bad_request(f"Field '{key}' must be >= 0.", key)
            return value
    return None


def _identity(headers: Mapping[str, str], policy: RequestPolicy) -> tuple[int, str, str]:
    """Priority, fairness id and objective name, from trusted sources only: an untrusted
    client's headers cannot raise its priority, pose as another tenant or claim an objective."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    key = policy.api_keys.get(token.strip()) if scheme.lower() == "bearer" else None
    if key is not None:
        objective = key.objective or ""
        return policy.objectives.get(objective, 0), key.tenant, objective
    objective = (
        headers.get(policy.objective_header, "") if policy.trusts(policy.objective_header) else ""
    )
    if objective not in policy.objectives:
        objective = ""
    fairness_id = (
        headers.get(policy.fairness_header) if policy.trusts(policy.fairness_header) else None
    )
    return _priority(headers, policy, objective), fairness_id or wire.DEFAULT_FLOW, objective


def _session(headers: Mapping[str, str], name: str) -> str | None:
    """The request's session key: a fixed-size digest of its session header (None without
    one); a header over :data:`MAX_SESSION_BYTES` is a 400."""
    raw = headers.get(name)
    if not raw:
        return None
    encoded = raw.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_SESSION_BYTES:
        raise bad_request(
            f"Header '{name}' must be at most {MAX_SESSION_BYTES} bytes, got {len(encoded)}.",
            name,
        )
    return session_key(encoded)


def session_key(raw: bytes) -> str:
    """What the session tables store for a session header's bytes."""
    return hashlib.blake2b(raw, digest_size=SESSION_DIGEST_BYTES).hexdigest()


def _priority(headers: Mapping[str, str], policy: RequestPolicy, objective: str) -> int:
    """A trusted priority header, else the objective's priority (0 for none)."""
    raw = headers.get(policy.priority_header) if policy.trusts(policy.priority_header) else None
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            raise bad_request(
                f"Header '{policy.priority_header}' must be an integer, got '{raw}'."
            ) from None
    return policy.objectives.get(objective, 0)


# A prompt as read from a body: the text to hash, token ids if given, the conversation if any.
_Prompt = tuple[str, tuple[int, ...] | None, tuple[ChatMessage, ...]]


def _completion_prompt(data: Mapping[str, Any]) -> _Prompt:
    return _text_or_tokens(data, "prompt")


def _embedding_input(data: Mapping[str, Any]) -> _Prompt:
    return _text_or_tokens(data, "input")


def _text_or_tokens(data: Mapping[str, Any], key: str) -> _Prompt:
    """A prompt as vLLM accepts it: a string, strings, token ids, or lists of token ids."""
    value = data.get(key)
    if value is None:
        raise bad_request(f"Missing required field '{key}'.", key)
    if isinstance(value, str):
        return value, None, ()
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return "\n".join(value), None, ()
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "", tuple(value), ()
        if all(isinstance(v, list) for v in value):
            flat = [t for seq in value for t in seq]
            if all(isinstance(t, int) and not isinstance(t, bool) for t in flat):
                return "", tuple(flat), ()
    raise bad_request(
        f"Field '{key}' must be a string, an array of strings, an array of token ids "
        "or an array of token id arrays.",
        key,
    )


def _chat_prompt(data: Mapping[str, Any]) -> _Prompt:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("Field 'messages' must be a non-empty array.", "messages")
    conversation = _conversation(messages, "messages")
    return hashing_text(conversation), None, conversation


def _responses_prompt(data: Mapping[str, Any]) -> _Prompt:
    instructions = _optional(data, "instructions", str)
    value = data.get("input")
    conversation: tuple[ChatMessage, ...]
    if isinstance(value, str):
        conversation = (ChatMessage("user", (ContentPart("text", value),)),)
    elif isinstance(value, list) and value:
        conversation = _conversation(value, "input")
    else:
        raise bad_request("Field 'input' must be a string or a non-empty array.", "input")
    if instructions:
        conversation = (ChatMessage("system", (ContentPart("text", instructions),)), *conversation)
    return hashing_text(conversation), None, conversation


def _conversation(messages: list[Any], key: str) -> tuple[ChatMessage, ...]:
    conversation: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"'{key}[{i}]' must be an object.", key)
        role = message.get("role", message.get("type", ""))
        if not isinstance(role, str):
            raise bad_request(f"'{key}[{i}].role' must be a string.", key)
        conversation.append(ChatMessage(role, _content_parts(message.get("content"), key, i)))
    return tuple(conversation)


def _content_parts(content: Any, key: str, index: int) -> tuple[ContentPart, ...]:
    """A message's content as parts, as vLLM reads it: a string is one text part, a text part
    without text is skipped (an empty one is kept: templates that iterate over parts see it)."""
    if content is None:
        return ()
    if isinstance(content, str):
        return (ContentPart("text", content),)
    if not isinstance(content, list):
        raise bad_request(f"'{key}[{index}].content' must be a string or an array of parts.", key)
    parts: list[ContentPart] = []
    for part in content:
        if isinstance(part, str):
            parts.append(ContentPart("text", part))
        elif isinstance(part, dict):
            parsed = _typed_part(part, key)
            if parsed is not None:
                parts.append(parsed)
        else:
            raise bad_request(f"'{key}[{index}].content' has a malformed part.", key)
    return tuple(parts)


def _typed_part(part: Mapping[str, Any], key: str) -> ContentPart | None:
    kind = part.get("type", "text")
    if not isinstance(kind, str):
        raise bad_request("A content part's 'type' must be a string.", key)
    text_key = _TEXT_PART_KEYS.get(kind)
    if text_key is not None:
        text = part.get(text_key)
        if text is None:
            return None
        if not isinstance(text, str):
            raise bad_request(f"A '{kind}' content part's '{text_key}' must be a string.", key)
        return ContentPart("text", text)
    media = part.get("image_url", part.get("input_audio", part))
    reference = media.get("url") if isinstance(media, dict) else media
    if not isinstance(reference, str):
        reference = json.dumps(media, sort_keys=True)
    return ContentPart("image" if kind in _IMAGE_PART_TYPES else "other", reference)


_PROMPT_READERS = {
    "completions": _completion_prompt,
    "chat": _chat_prompt,
    "responses": _responses_prompt,
    "embeddings": _embedding_input,
}
