"""Turn an OpenAI HTTP request into the :class:`InferenceRequest` scheduling works on.

Parsing is strict about types (a wrongly typed field is a 400 naming the field, never a silent
wrong route) and lenient about fields it does not need (they pass through to the engine).
The prompt text extracted here is what prefix scorers hash, so its construction matters: for
chat the conversation is laid out message by message in order, so that a later turn's text
starts with exactly the text of the earlier turns and matches their cached blocks.

Chat and responses conversations are kept structured (:class:`ChatMessage`: a role and typed
content parts). Both the text prefix scorers hash (:func:`hashing_text`) and the chat template's
input (:meth:`ChatMessage.template_content`) are derived from that structure here, with every
separator declared once (:mod:`~epp.request.messages`), so they cannot drift apart or from the
engine's.

The parts: :mod:`~epp.request.parse` (headers checks, body -> request),
:mod:`~epp.request.decode` (strict JSON), :mod:`~epp.request.prompts` (each API's prompt and
fields), :mod:`~epp.request.messages` (the conversation), :mod:`~epp.request.identity` (header
policy, API keys, sessions, latency targets) and :mod:`~epp.request.inference` (the request
scheduling works on).
"""

from __future__ import annotations

from epp.request.decode import load_body, too_deep
from epp.request.identity import (
    MAX_SESSION_BYTES,
    SESSION_DIGEST_BYTES,
    ApiKey,
    LatencyTarget,
    RequestPolicy,
    session_key,
)
from epp.request.inference import (
    CHARS_PER_TOKEN,
    DEFAULT_OUTPUT_TOKENS,
    Api,
    InferenceRequest,
    api_for_path,
)
from epp.request.messages import (
    MEDIA_MARK,
    MESSAGE_SEPARATOR,
    ROLE_SEPARATOR,
    TEXT_PART_SEPARATOR,
    ChatMessage,
    ContentPart,
    PartKind,
    hashing_text,
)
from epp.request.parse import check_headers, parse_decoded, parse_request, set_engine_priority

__all__ = [
    "CHARS_PER_TOKEN",
    "DEFAULT_OUTPUT_TOKENS",
    "MAX_SESSION_BYTES",
    "MEDIA_MARK",
    "MESSAGE_SEPARATOR",
    "ROLE_SEPARATOR",
    "SESSION_DIGEST_BYTES",
    "TEXT_PART_SEPARATOR",
    "Api",
    "ApiKey",
    "ChatMessage",
    "ContentPart",
    "InferenceRequest",
    "LatencyTarget",
    "PartKind",
    "RequestPolicy",
    "api_for_path",
    "check_headers",
    "hashing_text",
    "load_body",
    "parse_decoded",
    "parse_request",
    "session_key",
    "set_engine_priority",
    "too_deep",
]
