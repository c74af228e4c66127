"""Envoy's own replies (timeouts, malformed HTTP, refused authentication, an overloaded
gateway, no reachable replica) rewritten as OpenAI-style JSON errors."""

from __future__ import annotations

import json
from typing import Any

from epp.config import Config
from epp.envoy_config.common import Mode


def _json_reply(
    status_filter: dict[str, Any], error_type: str, code: str, message: str
) -> dict[str, Any]:
    """A local-reply mapper that gives one class of Envoy's own replies an OpenAI error body."""
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}},
        separators=(",", ":"),
    )
    return {
        "filter": status_filter,
        "body_format_override": {
            "text_format_source": {"inline_string": body},
            "content_type": "application/json",
        },
    }


def _status_is(*codes: int) -> dict[str, Any]:
    filters = [
        {
            "status_code_filter": {
                "comparison": {
                    "op": "EQ",
                    "value": {"default_value": c, "runtime_key": f"epp.local_reply.{c}"},
                }
            }
        }
        for c in codes
    ]
    return filters[0] if len(filters) == 1 else {"or_filter": {"filters": filters}}


def _codec_refusal() -> dict[str, Any]:
    """Matches a reply to a request whose headers were never decoded: Envoy's HTTP codec
    refused it (no ``:method``), with an error status."""
    return {
        "and_filter": {
            "filters": [
                {
                    "status_code_filter": {
                        "comparison": {
                            "op": "GE",
                            "value": {
                                "default_value": 400,
                                "runtime_key": "epp.local_reply.codec",
                            },
                        }
                    }
                },
                {
                    "header_filter": {
                        "header": {
                            "name": ":method",
                            "present_match": True,
                            "invert_match": True,
                        }
                    }
                },
            ]
        }
    }


def local_replies(config: Config, mode: Mode) -> dict[str, Any]:
    """Clients get JSON errors from Envoy too, not only from epp.

    epp's immediate responses are already JSON and are never 504, never carry upstream response
    flags, and (in buffered mode) never 413, because Envoy refuses an oversized body before epp
    sees it; so these mappers only rewrite replies Envoy made itself.
    """
    mappers = [
        # The edge timeouts (edge.request_timeout_s, request_headers_timeout_s): a client too
        # slow to send its request. Ahead of the codec mapper, which a request whose headers
        # never completed would match too.
        _json_reply(
            _status_is(408),
            "invalid_request_error",
            "request_timeout",
            "The request was not received in time (%RESPONSE_CODE_DETAILS%): send it whole "
            "within the gateway's request timeout.",
        ),
        # Envoy's HTTP codec refusing a request it could not parse (431 for headers over 60 KiB,
        # 400 for control characters, conflicting framing, a bad request line): no request
        # headers were decoded, which is what tells these apart from epp's own 4xx (checked
        # with Envoy 1.40; the DPE response flag is set only after the reply, too late for a
        # mapper). Such replies skip ext_proc (see ext_proc_filter), or they would be lost
        # before they are written (docs/hostile-input.md).
        _json_reply(
            _codec_refusal(),
            "invalid_request_error",
            "invalid_http_request",
            "Envoy refused the request as malformed HTTP (%RESPONSE_CODE_DETAILS%): keep "
            "headers under 60 KiB, free of control characters, and send one body framing.",
        ),
        _json_reply(
            _status_is(500, 504),
            "server_error",
            "endpoint_picker_unavailable",
            "The endpoint picker failed or timed out (%RESPONSE_CODE_DETAILS%). Retry shortly.",
        ),
        _json_reply(
            {"response_flag_filter": {"flags": ["OM"]}},
            "service_unavailable_error",
            "gateway_overloaded",
            "The gateway is short of memory and refuses new requests for now. Retry shortly.",
        ),
        _json_reply(
            {"response_flag_filter": {"flags": ["UH", "UF", "UO", "URX", "NR", "NC", "UMSDR"]}},
            "service_unavailable_error",
            "upstream_unavailable",
            "No replica could serve this request: the chosen ones could not be reached, or the "
            "endpoint picker gave no answer (%RESPONSE_FLAGS%). Retry shortly.",
        ),
    ]
    if config.authentication.jwt is not None or config.authentication.service is not None:
        # jwt_authn's 401 (a token missing, expired, or not signed by a known key) and the
        # authorization service's refusals (flag UAEX, its status kept).
        mappers.insert(
            0,
            _json_reply(
                {
                    "or_filter": {
                        "filters": [_status_is(401), {"response_flag_filter": {"flags": ["UAEX"]}}]
                    }
                },
                "authentication_error",
                "unauthenticated",
                "The request could not be authenticated (%RESPONSE_CODE_DETAILS%).",
            ),
        )
    if mode == "buffered":
        mappers.insert(
            0,
            _json_reply(
                _status_is(413),
                "invalid_request_error",
                "request_too_large",
                f"Request body exceeds the limit of {config.routing.max_body_bytes} bytes.",
            ),
        )
    return {"mappers": mappers}
