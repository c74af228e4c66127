"""Token usage and token-carrying events of OpenAI responses, as vLLM writes them.

Two shapes exist: Completions and Chat Completions put ``usage`` at the top level
(``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``); the
Responses API puts it under ``response`` in its ``response.completed`` event
(``input_tokens``, ``output_tokens``, ``input_tokens_details.cached_tokens``). vLLM reports
``prompt_tokens_details`` only when started with ``--enable-prompt-tokens-details``; absent
cached tokens are None, not 0, so metrics do not claim a cache miss nobody measured.
"""

from __future__ import annotations

from typing import Any

import msgspec

from epp.lifecycle import Usage


def _count(value: Any) -> int | None:
    # bool is an int subclass; a JSON true is not a token count.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def usage_of(payload: Any) -> Usage | None:
    """The usage a decoded response body or SSE event reports, or None."""
    if not isinstance(payload, dict):
        return None
    found = payload.get("usage")
    if found is None and isinstance(payload.get("response"), dict):
        found = payload["response"].get("usage")
    if not isinstance(found, dict):
        return None
    prompt = _count(found.get("prompt_tokens", found.get("input_tokens")))
    completion = _count(found.get("completion_tokens", found.get("output_tokens")))
    if prompt is None or completion is None:
        return None
    details = found.get("prompt_tokens_details") or found.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt, completion, cached)


def carries_token(payload: Any) -> bool:
    """Whether an SSE event delivers generated output (the first one marks the first token).

    vLLM's first chat chunk only announces the role with empty content, and the final usage
    chunk has no choices: neither is a token.
    """
    if not isinstance(payload, dict):
        return False
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("text"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (
                delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
            ):
                return True
        return False
    # Responses API: response.output_text.delta, response.reasoning_text.delta, ...
    kind = payload.get("type")
    return isinstance(kind, str) and kind.endswith(".delta") and bool(payload.get("delta"))


def is_usage_only(payload: Any) -> bool:
    """The extra chunk ``stream_options.include_usage`` adds: usage and no choices."""
    return (
        isinstance(payload, dict)
        and isinstance(payload.get("usage"), dict)
        and not payload.get("choices")
    )


def decode(data: str | bytes) -> Any:
    """JSON of an event or body, or None when it is not JSON (``[DONE]``, an error page).
    msgspec: several times the standard library's speed on every streamed event."""
    try:
        return _DECODER.decode(data)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None


_DECODER = msgspec.json.Decoder()
