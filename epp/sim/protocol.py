"""OpenAI request parsing and response shapes, as vLLM's OpenAI server produces them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any


class APIError(Exception):
    """An OpenAI-style error response (vLLM's ErrorResponse)."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "APIError"),
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class GenerationParams:
    """The fields of a completions / chat body that change what the simulator does."""

    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    # vLLM's extra parameter: lower is served first under --scheduling-policy priority.
    priority: int


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer", name)
    if value < 1:
        raise APIError(400, f"{name} must be at least 1, got {value}.", name)
    return value


def parse_generation(body: Any, default_model: str, default_max_tokens: int) -> GenerationParams:
    """Validate the common fields. `ignore_eos` and sampling fields are accepted and have no
    effect: the simulator always generates exactly max_tokens tokens."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model") or default_model
    if not isinstance(model, str):
        raise APIError(400, "'model' must be a string", "model")
    # Chat's max_completion_tokens supersedes the deprecated max_tokens.
    max_tokens = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens")
    n = body.get("n", 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported by the simulator", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    if options and not stream:
        raise APIError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise APIError(400, "'priority' must be an integer", "priority")
    return GenerationParams(
        model=model,
        max_tokens=max_tokens or default_max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        priority=priority,
    )


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """A single prompt: text or token ids. Batched prompts (lists of prompts) are refused."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    if prompt is None:
        raise APIError(400, "'prompt' is required", "prompt")
    raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt)", "prompt")


def chat_messages(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    return messages


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


@dataclass
class ResponseShape:
    """Builds the bodies of one completions or chat response (stream or not)."""

    chat: bool
    model: str
    request_id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> ResponseShape:
        return cls(chat, model, new_id("chatcmpl" if chat else "cmpl"), int(time.time()))

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, text: str, finish_reason: str, use: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            body = self._envelope("text_completion", [choice])
        body["usage"] = use
        return body

    def chunk(self, text: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        """One streamed choice delta. The chat stream opens with a role-only delta."""
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if role else {"content": text}
            )
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = use
        return body
