"""The body epp forwards: one re-serialisation for every change epp makes to a request (the
model rewrite, the engine priority, the usage option)."""

from __future__ import annotations

import json
from typing import Any

from epp.lifecycle import RequestContext
from epp.request import InferenceRequest, set_engine_priority, too_deep

# APIs whose streaming requests accept ``stream_options.include_usage``.
_USAGE_OPTION_APIS = ("completions", "chat")


def rewrite_body(
    context: RequestContext, request: InferenceRequest, data: dict[str, Any]
) -> bytes | None:
    """The body to forward instead of the client's, or None to forward it unchanged: one
    re-serialisation for every change epp makes (the model rewrite, the engine priority, the
    usage option)."""
    policy = context.generation.config.request
    renamed = _rename(context, request, data)
    changed = policy.engine_priority and set_engine_priority(request, data)
    asked_usage = _ask_for_usage(context, request, data)
    context.usage_expected = _expects_usage(request, data)
    if not (renamed or changed or asked_usage):
        return None
    try:
        rewritten = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    except RecursionError:
        # Parsed near the recursion limit, the body is one level too deep to write back
        # from here. Without the usage option it can go as it is; not with a priority epp
        # had to set or overwrite (the client's own would reach the engine).
        if changed or renamed:
            raise too_deep() from None
        return None
    context.strip_usage = asked_usage
    return rewritten


def _rename(context: RequestContext, request: InferenceRequest, data: dict[str, Any]) -> bool:
    """Apply the model rewrite that matches (epp.rewrite): the request is scheduled, and
    the body forwarded, with the target model; True when ``data`` changed."""
    rewrite = context.generation.rewrites.choose(request.model, request.session)
    context.rewrite = rewrite
    if rewrite is None or rewrite.target == request.model:
        return False
    request.model = data["model"] = rewrite.target
    return True


def _ask_for_usage(
    context: RequestContext, request: InferenceRequest, data: dict[str, Any]
) -> bool:
    """With ``routing.inject_stream_usage``, a streaming request that did not ask for
    usage gets ``stream_options.include_usage`` (True when ``data`` was changed) and the
    usage chunk it brings is later removed from what the client receives."""
    if not (
        context.generation.config.routing.inject_stream_usage
        and request.stream
        and request.api in _USAGE_OPTION_APIS
    ):
        return False
    if _asks_usage(data):
        return False
    options = data.get("stream_options")
    data["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return True


def _expects_usage(request: InferenceRequest, data: dict[str, Any]) -> bool:
    """Whether the streamed response to ``data`` (as forwarded) ends with usage: the only
    place the engine's cached prompt tokens arrive. A non-streamed response always carries it,
    but has no first token for the latency model to learn from."""
    if not request.stream:
        return False
    return request.api == "responses" or _asks_usage(data)


def _asks_usage(data: dict[str, Any]) -> bool:
    """Whether ``data`` asks for the usage chunk (``stream_options.include_usage``)."""
    options = data.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
