"""Builders for the ProcessingResponse messages epp sends to Envoy.

Header values are always set through ``raw_value``: Envoy 1.40 writes an empty header when only
``value`` is set. The routing answer goes out twice with identical values (a request header and
``envoy.lb`` dynamic metadata) because gateways differ in which one they read; metadata cannot be
forged by a client, so our Envoy configuration routes on it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import cast

from google.protobuf.struct_pb2 import Struct

from epp._proto import core_pb2, ext_proc_pb2, http_status_pb2
from epp.errors import RequestError
from epp.wire import DESTINATION, LB_NAMESPACE, OVERFLOW, SCORES

# Envoy accepts streamed body chunks up to 64 KiB; GIE uses 62,000 to leave room for framing.
MAX_CHUNK = 62_000

_OVERWRITE = core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Request headers set along with the pick, as ``(name, value)`` pairs.
Headers = tuple[tuple[str, str], ...]

CONTINUE_REQUEST_HEADERS = ext_proc_pb2.ProcessingResponse(
    request_headers=ext_proc_pb2.HeadersResponse()
)
CONTINUE_RESPONSE_HEADERS = ext_proc_pb2.ProcessingResponse(
    response_headers=ext_proc_pb2.HeadersResponse()
)
CONTINUE_REQUEST_BODY = ext_proc_pb2.ProcessingResponse(request_body=ext_proc_pb2.BodyResponse())
CONTINUE_RESPONSE_BODY = ext_proc_pb2.ProcessingResponse(response_body=ext_proc_pb2.BodyResponse())
CONTINUE_REQUEST_TRAILERS = ext_proc_pb2.ProcessingResponse(
    request_trailers=ext_proc_pb2.TrailersResponse()
)
CONTINUE_RESPONSE_TRAILERS = ext_proc_pb2.ProcessingResponse(
    response_trailers=ext_proc_pb2.TrailersResponse()
)


def _header(key: str, value: str) -> core_pb2.HeaderValueOption:
    return core_pb2.HeaderValueOption(
        header=core_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _routing(
    destination: str,
    remove: Iterable[str],
    content_length: int | None,
    scores: str | None,
    overflow: str | None,
    extra: Headers = (),
) -> tuple[ext_proc_pb2.CommonResponse, Struct]:
    """The picked endpoints (``destination``), or with ``overflow`` the overflow pool to spill
    to: no endpoint, the route matching the overflow header sends it to that pool's gateway.
    ``extra``: headers set besides (a disaggregated request's prefill replica)."""
    if overflow is not None:
        sets = [_header(OVERFLOW, overflow)]
    else:
        sets = [_header(DESTINATION, destination)]
    sets.extend(_header(k, v) for k, v in extra)
    if content_length is not None:
        sets.append(_header("content-length", str(content_length)))
    common = ext_proc_pb2.CommonResponse(
        header_mutation=ext_proc_pb2.HeaderMutation(set_headers=sets, remove_headers=remove),
        # The route (and so the cluster and host) must be recomputed from the new header.
        clear_route_cache=True,
    )
    metadata = Struct()
    fields = metadata.fields[LB_NAMESPACE].struct_value.fields
    if overflow is None:
        fields[DESTINATION].string_value = destination
    if scores is not None:
        fields[SCORES].string_value = scores
    return common, metadata


def route_in_headers(
    destination: str,
    remove: Iterable[str],
    content_length: int | None,
    scores: str | None = None,
    overflow: str | None = None,
    extra: Headers = (),
) -> ext_proc_pb2.ProcessingResponse:
    """Routing answer to the request-headers message (full-duplex mode, or header-only).

    Without scores, the answer is a copy of one built once per destination list, headers to
    remove and overflow pool (see :func:`route_in_body`), with the body's length added (a copy
    is far cheaper than building the nested messages and metadata again)."""
    if scores is None:
        plain = _plain_route_in_headers(destination, tuple(remove), overflow, extra)
        if content_length is None:
            return plain
        answer = ext_proc_pb2.ProcessingResponse()
        answer.CopyFrom(plain)
        # Added in place: a header option built apart would be copied in (as _header's is).
        option = answer.request_headers.response.header_mutation.set_headers.add(
            append_action=_OVERWRITE
        )
        header = option.header
        header.key = "content-length"
        header.raw_value = str(content_length).encode()
        return answer
    return _route_in_headers(destination, remove, content_length, scores, overflow, extra)


@functools.lru_cache(maxsize=4096)
def _plain_route_in_headers(
    destination: str, remove: tuple[str, ...], overflow: str | None, extra: Headers
) -> ext_proc_pb2.ProcessingResponse:
    return _route_in_headers(destination, remove, None, None, overflow, extra)


def _route_in_headers(
    destination: str,
    remove: Iterable[str],
    content_length: int | None,
    scores: str | None,
    overflow: str | None,
    extra: Headers = (),
) -> ext_proc_pb2.ProcessingResponse:
    common, metadata = _routing(destination, remove, content_length, scores, overflow, extra)
    return ext_proc_pb2.ProcessingResponse(
        request_headers=ext_proc_pb2.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def route_in_body(
    destination: str,
    remove: Iterable[str],
    scores: str | None = None,
    body: bytes | None = None,
    overflow: str | None = None,
    extra: Headers = (),
) -> ext_proc_pb2.ProcessingResponse:
    """Routing answer to the buffered request-body message; the body itself is not echoed
    unless epp rewrote it (``body``), which then replaces it along with its Content-Length.

    Without scores or a new body the answer depends only on the destination list, the headers
    to remove and the overflow pool, which repeat from request to request: such answers are
    built once and shared (never modified once built; gRPC only serializes them)."""
    if scores is None and body is None:
        return _plain_route_in_body(destination, tuple(remove), overflow, extra)
    return _route_in_body(destination, remove, scores, body, overflow, extra)


# Both caches are sized for every ordered pair of a 64-endpoint pool (a pick and a fallback).
@functools.lru_cache(maxsize=4096)
def _plain_route_in_body(
    destination: str, remove: tuple[str, ...], overflow: str | None, extra: Headers
) -> ext_proc_pb2.ProcessingResponse:
    return _route_in_body(destination, remove, None, None, overflow, extra)


def _route_in_body(
    destination: str,
    remove: Iterable[str],
    scores: str | None,
    body: bytes | None,
    overflow: str | None,
    extra: Headers = (),
) -> ext_proc_pb2.ProcessingResponse:
    length = None if body is None else len(body)
    common, metadata = _routing(destination, remove, length, scores, overflow, extra)
    if body is not None:
        common.body_mutation.body = body
    return ext_proc_pb2.ProcessingResponse(
        request_body=ext_proc_pb2.BodyResponse(response=common), dynamic_metadata=metadata
    )


def add_response_headers(headers: Mapping[str, str]) -> ext_proc_pb2.ProcessingResponse:
    """Continue the response with ``headers`` added (tenant budgets' x-ratelimit-*)."""
    return ext_proc_pb2.ProcessingResponse(
        response_headers=ext_proc_pb2.HeadersResponse(
            response=ext_proc_pb2.CommonResponse(
                header_mutation=ext_proc_pb2.HeaderMutation(
                    set_headers=[_header(k, v) for k, v in headers.items()]
                )
            )
        )
    )


def body_chunks(
    body: bytes, end_of_stream: bool = True, response: bool = False
) -> Iterator[ext_proc_pb2.ProcessingResponse]:
    """A body streamed back in full-duplex mode, at most :data:`MAX_CHUNK` bytes a message.

    Only the last chunk carries ``end_of_stream``, and only if the body ended here. Each answer
    is filled through its field path: nested messages built first and passed to constructors
    would each be copied into their parent (five messages a chunk, on every full-duplex request
    and response body)."""
    last = max(len(body) - 1, 0) // MAX_CHUNK * MAX_CHUNK
    for offset in range(0, last + 1, MAX_CHUNK):
        answer = ext_proc_pb2.ProcessingResponse()
        part = answer.response_body if response else answer.request_body
        chunk = part.response.body_mutation.streamed_response
        chunk.body = body[offset : offset + MAX_CHUNK]  # the body itself when it fits
        chunk.end_of_stream = end_of_stream and offset == last
        yield answer


def stream_back(chunks: Sequence[bytes]) -> Iterator[ext_proc_pb2.ProcessingResponse]:
    """A full-duplex request body streamed back as it arrived: each chunk as one message
    (split only above :data:`MAX_CHUNK`), the last one carrying ``end_of_stream``."""
    if not chunks:
        yield from body_chunks(b"")
        return
    last = len(chunks) - 1
    for i, chunk in enumerate(chunks):
        yield from body_chunks(chunk, i == last)


def replace_response_body(body: bytes) -> ext_proc_pb2.ProcessingResponse:
    """A STREAMED response chunk replaced by ``body`` (epp removed an event from it)."""
    answer = ext_proc_pb2.ProcessingResponse()
    answer.response_body.response.body_mutation.body = body
    return answer


def immediate(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    extra: Mapping[str, str] | None = None,
) -> ext_proc_pb2.ProcessingResponse:
    """An immediate local reply: Envoy answers the client and never contacts an upstream."""
    return ext_proc_pb2.ProcessingResponse(
        immediate_response=ext_proc_pb2.ImmediateResponse(
            # An open enum: any HTTP status number is a valid value.
            status=http_status_pb2.HttpStatus(code=cast(http_status_pb2.StatusCode, status)),
            headers=ext_proc_pb2.HeaderMutation(
                set_headers=[
                    _header("content-type", content_type),
                    *(_header(k, v) for k, v in (extra or {}).items()),
                ]
            ),
            body=body,
        )
    )


def error_response(error: RequestError) -> ext_proc_pb2.ProcessingResponse:
    return immediate(error.status, error.body(), extra=error.headers)
