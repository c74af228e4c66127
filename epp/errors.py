"""Errors that become immediate HTTP responses with OpenAI-style JSON bodies.

Every way a request can be refused is one :class:`RequestError`; the ext_proc layer turns it
into an ``ImmediateResponse`` so the client sees the same shape of error an OpenAI server returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping


class RequestError(Exception):
    """A request epp refuses, with the HTTP status and OpenAI error fields to send back."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        # Extra response headers (Retry-After and the drop reason of a flow-control refusal).
        self.headers: Mapping[str, str] = headers or {}

    def body(self) -> bytes:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}, separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_request")


def model_not_found(model: str, known: list[str]) -> RequestError:
    listing = ", ".join(sorted(known)) or "(none configured)"
    return RequestError(
        404,
        f"The model '{model}' does not exist. Available models: {listing}.",
        param="model",
        code="model_not_found",
    )


def body_too_large(size: int, limit: int) -> RequestError:
    return RequestError(
        413,
        f"Request body of {size} bytes exceeds the limit of {limit} bytes.",
        code="request_too_large",
    )


def no_endpoint(model: str, why: str) -> RequestError:
    return RequestError(
        503,
        f"No endpoint is ready to serve model '{model}': {why}. Retry shortly.",
        type="service_unavailable_error",
        code="no_ready_endpoint",
    )


def no_pool_endpoint(pool: str, path: str) -> RequestError:
    return RequestError(
        503,
        f"No replica of pool '{pool}' is ready to serve {path} (a pass-through path). "
        "Retry shortly.",
        type="service_unavailable_error",
        code="no_ready_endpoint",
    )


def overloaded(model: str) -> RequestError:
    return RequestError(
        429,
        f"The pool serving '{model}' is saturated and this request's priority is sheddable. "
        "Retry later or send it with a higher priority.",
        type="rate_limit_error",
        code="overloaded",
    )


def target_unreachable(model: str, ttft: float | None, tpot: float | None) -> RequestError:
    targets = " and ".join(
        f"{what} within {seconds * 1000:.0f} ms"
        for what, seconds in (("the first token", ttft), ("each further token", tpot))
        if seconds is not None
    )
    return RequestError(
        429,
        f"No endpoint serving '{model}' is predicted to deliver {targets}, the request's "
        "latency target. Retry later or relax the target.",
        type="rate_limit_error",
        code="latency_target_unreachable",
    )


def unknown_path(method: str, path: str) -> RequestError:
    return RequestError(
        404,
        f"Invalid URL ({method} {path.split('?', 1)[0] or '/'}): epp routes POST /v1/completions, "
        "/v1/chat/completions, /v1/responses and /v1/embeddings, and answers GET /v1/models; "
        "other paths reach the replicas only when routing.passthrough names them.",
        code="unknown_url",
    )


def unsupported_media_type(content_type: str) -> RequestError:
    return RequestError(
        415,
        f"Content-Type '{content_type}' is not JSON: send the body as application/json "
        "(curl -d needs -H 'Content-Type: application/json').",
        param="content-type",
        code="unsupported_media_type",
    )
