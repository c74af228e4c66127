"""What scheduling works on: :class:`InferenceRequest`, the OpenAI APIs epp routes and the
paths that address them, and the token estimates used for load accounting."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from epp import wire
from epp.request.messages import ChatMessage

Api = Literal["completions", "chat", "responses", "embeddings"]


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
