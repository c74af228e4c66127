"""The prompt of each OpenAI API read from a decoded body: text or token ids (completions,
embeddings), the conversation (chat, responses), and the typed optional fields parsing reads
(``stream``, the output limit). A wrongly typed field is a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from epp.errors import bad_request
from epp.request.inference import Api
from epp.request.messages import ChatMessage, ContentPart, hashing_text

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
    instructions = optional(data, "instructions", str)
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


# Content part types vLLM reads as text, and the key each keeps its text under.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
}
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})


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


PROMPT_READERS = {
    "completions": _completion_prompt,
    "chat": _chat_prompt,
    "responses": _responses_prompt,
    "embeddings": _embedding_input,
}


def check_encodable(text: str) -> None:
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


def optional(data: Mapping[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    # bool is a subclass of int; a JSON true is not a token count.
    if value is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return value
    raise bad_request(f"Field '{key}' must be of type {_TYPE_NAMES[kind]}.", key)


_TYPE_NAMES = {bool: "boolean", int: "integer", str: "string", list: "array"}


def max_tokens(api: Api, data: Mapping[str, Any]) -> int | None:
    keys = {
        "completions": ("max_tokens",),
        "chat": ("max_completion_tokens", "max_tokens"),
        "responses": ("max_output_tokens",),
        "embeddings": (),
    }[api]
    for key in keys:
        value: int | None = optional(data, key, int)
        if value is not None:
            if value < 0:
                raise bad_request(f"Field '{key}' must be >= 0.", key)
            return value
    return None
