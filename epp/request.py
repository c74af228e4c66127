"""Turn an OpenAI HTTP request into the :class:`InferenceRequest` scheduling works on.

Parsing is strict about types (a wrongly typed field is a 400 naming the field, never a silent
wrong route) and lenient about fields it does not need (they pass through to the engine).
The prompt text extracted here is what prefix scorers hash, so its construction matters: for
chat the conversation is laid out message by message in order, so that a later turn's text
starts with exactly the text of the earlier turns and matches their cached blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from epp.errors import bad_request

Api = Literal["completions", "chat", "responses", "embeddings"]

# Longest suffix first: "/chat/completions" also ends with "/completions".
_API_BY_SUFFIX: tuple[tuple[str, Api], ...] = (
    ("/chat/completions", "chat"),
    ("/completions", "completions"),
    ("/responses", "responses"),
    ("/embeddings", "embeddings"),
)

# vLLM generates up to the context length when a chat request names no limit; assume a typical
# answer length for load accounting rather than the worst case.
DEFAULT_OUTPUT_TOKENS = 256
# Characters per token of English text under common BPE tokenizers, for estimates only.
CHARS_PER_TOKEN = 4

# Separators that cannot appear in ordinary text keep "role + content" boundaries unambiguous.
_ROLE_SEP = "\x1f"
_MSG_SEP = "\x1e"


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """Which headers carry priority and session, and how objectives map to priorities."""

    session_header: str = "x-session-token"
    priority_header: str = "x-priority"
    objective_header: str = "x-gateway-inference-objective"
    objectives: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class InferenceRequest:
    """What scheduling needs to know about one request."""

    request_id: str
    path: str
    api: Api
    model: str
    prompt: str
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    stream: bool = False
    priority: int = 0
    session: str | None = None
    # The LoRA adapter the request runs on (set by the router from the model's configuration).
    lora: str | None = None
    body_size: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)

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
    """The OpenAI API a path addresses, judged by suffix so ``/openai/v1/...`` prefixes work."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in _API_BY_SUFFIX:
        if path.endswith(suffix):
            return api
    return None


def parse_request(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    policy: RequestPolicy,
) -> InferenceRequest:
    """Parse an OpenAI request body; raise :class:`~epp.errors.RequestError` (400) if malformed."""
    api = api_for_path(path)
    if api is None:
        raise bad_request(
            f"Unsupported path '{path}': epp routes /v1/completions, /v1/chat/completions, "
            "/v1/responses and /v1/embeddings."
        )
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object.")

    model = data.get("model")
    if model is None:
        raise bad_request("Missing required field 'model'.", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("Field 'model' must be a non-empty string.", "model")

    prompt, token_ids = _PROMPT_READERS[api](data)
    return InferenceRequest(
        request_id=headers.get("x-request-id") or os.urandom(12).hex(),
        path=path,
        api=api,
        model=model,
        prompt=prompt,
        prompt_token_ids=token_ids,
        max_tokens=_max_tokens(api, data),
        stream=_optional(data, "stream", bool) or False,
        priority=_priority(headers, policy),
        session=headers.get(policy.session_header) or None,
        body_size=len(body),
        headers=headers,
    )


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
        value = _optional(data, key, int)
        if value is not None:
            if value < 0:
                raise bad_request(f"Field '{key}' must be >= 0.", key)
            return value
    return None


def _priority(headers: Mapping[str, str], policy: RequestPolicy) -> int:
    raw = headers.get(policy.priority_header)
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            raise bad_request(
                f"Header '{policy.priority_header}' must be an integer, got '{raw}'."
            ) from None
    objective = headers.get(policy.objective_header)
    if objective is not None:
        return policy.objectives.get(objective, 0)
    return 0


def _completion_prompt(data: Mapping[str, Any]) -> tuple[str, tuple[int, ...] | None]:
    return _text_or_tokens(data, "prompt")


def _embedding_input(data: Mapping[str, Any]) -> tuple[str, tuple[int, ...] | None]:
    return _text_or_tokens(data, "input")


def _text_or_tokens(data: Mapping[str, Any], key: str) -> tuple[str, tuple[int, ...] | None]:
    """A prompt as vLLM accepts it: a string, strings, token ids, or lists of token ids."""
    value = data.get(key)
    if value is None:
        raise bad_request(f"Missing required field '{key}'.", key)
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return "\n".join(value), None
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "", tuple(value)
        if all(isinstance(v, list) for v in value):
            flat = [t for seq in value for t in seq]
            if all(isinstance(t, int) and not isinstance(t, bool) for t in flat):
                return "", tuple(flat)
    raise bad_request(
        f"Field '{key}' must be a string, an array of strings, an array of token ids "
        "or an array of token id arrays.",
        key,
    )


def _chat_prompt(data: Mapping[str, Any]) -> tuple[str, None]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("Field 'messages' must be a non-empty array.", "messages")
    return _conversation(messages, "messages"), None


def _responses_prompt(data: Mapping[str, Any]) -> tuple[str, None]:
    instructions = _optional(data, "instructions", str)
    value = data.get("input")
    if isinstance(value, str):
        text = f"user{_ROLE_SEP}{value}{_MSG_SEP}"
    elif isinstance(value, list) and value:
        text = _conversation(value, "input")
    else:
        raise bad_request("Field 'input' must be a string or a non-empty array.", "input")
    if instructions:
        text = f"system{_ROLE_SEP}{instructions}{_MSG_SEP}{text}"
    return text, None


def _conversation(messages: list[Any], key: str) -> str:
    parts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"'{key}[{i}]' must be an object.", key)
        role = message.get("role", message.get("type", ""))
        if not isinstance(role, str):
            raise bad_request(f"'{key}[{i}].role' must be a string.", key)
        parts.append(f"{role}{_ROLE_SEP}{_content_text(message.get('content'), key, i)}{_MSG_SEP}")
    return "".join(parts)


def _content_text(content: Any, key: str, index: int) -> str:
    """Text of a message's content: a string, or the text (and media references) of its parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                # Media parts contribute their reference so different images never match.
                value = part.get("text", part.get("image_url", part.get("input_audio", "")))
                texts.append(value if isinstance(value, str) else json.dumps(value, sort_keys=True))
            else:
                raise bad_request(f"'{key}[{index}].content' has a malformed part.", key)
        return "".join(texts)
    raise bad_request(f"'{key}[{index}].content' must be a string or an array of parts.", key)


_PROMPT_READERS = {
    "completions": _completion_prompt,
    "chat": _chat_prompt,
    "responses": _responses_prompt,
    "embeddings": _embedding_input,
}
