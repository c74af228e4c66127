"""The per-request state machine of one ext_proc stream, free of gRPC so it can be unit-tested.

Envoy sends request headers, then body chunks, then (with SEND trailer modes) trailers. epp
buffers the body to end of stream in both BUFFERED and FULL_DUPLEX_STREAMED modes, because the
routing decision needs the whole JSON body:

- BUFFERED: answer the headers at once with CONTINUE; the body arrives in one message and the
  routing answer rides on the body response (Envoy applies header mutations sent there).
- FULL_DUPLEX_STREAMED: Envoy does not wait for answers, so the headers answer is held back until
  the body is complete; then epp sends the routing headers answer and streams the body back.

Anything wrong with the request becomes an immediate response with an OpenAI-style error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epp import errors
from epp._proto import ext_proc_pb2, processing_mode_pb2
from epp.errors import RequestError
from epp.extproc import responses
from epp.observability import REQUESTS
from epp.request import InferenceRequest, parse_request
from epp.router import Router
from epp.state.inflight import Ticket

log = logging.getLogger("epp.extproc")

Response = ext_proc_pb2.ProcessingResponse
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED

# Headers a client must not be able to set: they steer routing between gateway and epp.
CONTROL_HEADERS = (
    responses.DESTINATION_HEADER,
    responses.SUBSET_KEY,
    "x-gateway-destination-endpoint-served",
)


@dataclass(frozen=True, slots=True)
class Pending:
    """A parsed request held until the servicer has awaited its preparation."""

    request: InferenceRequest
    body: bytes
    after: tuple[Response, ...]


class StreamHandler:
    """Consumes one stream's ProcessingRequests and produces the ProcessingResponses to send."""

    __slots__ = (
        "_body",
        "_body_size",
        "_done",
        "_full_duplex",
        "_headers",
        "_response_full_duplex",
        "_router",
        "_subset",
        "pending",
        "ticket",
    )

    def __init__(self, router: Router) -> None:
        self._router = router
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._full_duplex = False
        self._response_full_duplex = False
        self._subset: list[str] | None = None
        self._done = False
        # In-flight accounting of the pick, released by the servicer when the stream ends.
        self.ticket: Ticket | None = None
        # A parsed request waiting for the servicer to await Router.prepare.
        self.pending: Pending | None = None

    def handle(self, message: ext_proc_pb2.ProcessingRequest) -> Sequence[Response]:
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self._full_duplex = config.request_body_mode == _FULL_DUPLEX
            self._response_full_duplex = config.response_body_mode == _FULL_DUPLEX
        if kind == "request_headers":
            return self._on_headers(message)
        if kind == "request_body":
            return self._on_body(message.request_body)
        if kind == "request_trailers":
            return self._on_trailers()
        if kind == "response_headers":
            return (responses.CONTINUE_RESPONSE_HEADERS,)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "response_trailers":
            return (responses.CONTINUE_RESPONSE_TRAILERS,)
        return ()

    def _on_headers(self, message: ext_proc_pb2.ProcessingRequest) -> Sequence[Response]:
        headers = self._headers
        for h in message.request_headers.headers.headers:
            headers[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        self._subset = _subset_hint(message)
        if message.request_headers.end_of_stream:
            self._done = True
            return (self._header_only(),)
        if self._full_duplex:
            return ()
        return (responses.CONTINUE_REQUEST_HEADERS,)

    def _on_body(self, body: ext_proc_pb2.HttpBody) -> Sequence[Response]:
        if self._done:
            # Envoy may deliver the end-of-stream chunk twice for ~1 MB bodies: ignore repeats.
            return ()
        if body.body:
            self._body.append(body.body)
            self._body_size += len(body.body)
            limit = self._router.config.routing.max_body_bytes
            if self._body_size > limit:
                self._done = True
                return (self._refuse(errors.body_too_large(self._body_size, limit)),)
        if not body.end_of_stream:
            # BUFFERED_PARTIAL/STREAMED chunks are acknowledged; full duplex expects no answer.
            return () if self._full_duplex else (responses.CONTINUE_REQUEST_BODY,)
        return self._complete()

    def _on_trailers(self) -> Sequence[Response]:
        # Full duplex with trailers: the body ended without an end_of_stream chunk.
        if not self._done and self._full_duplex:
            return self._complete(after=(responses.CONTINUE_REQUEST_TRAILERS,))
        return (responses.CONTINUE_REQUEST_TRAILERS,)

    def _on_response_body(self, body: ext_proc_pb2.HttpBody) -> Sequence[Response]:
        if not self._response_full_duplex:
            return (responses.CONTINUE_RESPONSE_BODY,)
        # Full-duplex responses must be echoed chunk by chunk; epp never changes them.
        return tuple(responses.body_chunks(body.body, body.end_of_stream, response=True))

    def _complete(self, after: Sequence[Response] = ()) -> Sequence[Response]:
        """The body is whole: parse it, then route now, or leave it in :attr:`pending` when the
        profile has preparation to await first (the servicer awaits it, then calls
        :meth:`resume`). ``after`` follows the routing answer."""
        self._done = True
        body = b"".join(self._body)
        self._body.clear()
        headers = self._headers
        try:
            request = parse_request(
                headers.get(":path", ""), headers, body, self._router.config.request
            )
        except RequestError as error:
            return (self._refuse(error), *after)
        if self._router.needs_preparation():
            self.pending = Pending(request, body, tuple(after))
            return ()
        return self._route(request, body, after)

    def resume(self) -> Sequence[Response]:
        """Route the :attr:`pending` request, once its preparation has been awaited."""
        pending = self.pending
        if pending is None:
            return ()
        self.pending = None
        return self._route(pending.request, pending.body, pending.after)

    def _route(
        self, request: InferenceRequest, body: bytes, after: Sequence[Response]
    ) -> Sequence[Response]:
        try:
            decision, self.ticket = self._router.route(request, self._subset)
        except RequestError as error:
            return (self._refuse(error), *after)
        destination = ",".join(e.address for e in decision.endpoints)
        remove = _present(self._headers, CONTROL_HEADERS)
        scores = None
        if decision.scores is not None:
            scores = json.dumps(decision.scores, separators=(",", ":"), sort_keys=True)
        if self._full_duplex:
            return (
                responses.route_in_headers(destination, remove, len(body), scores),
                *responses.body_chunks(body),
                *after,
            )
        return (responses.route_in_body(destination, remove, scores), *after)

    def _header_only(self) -> Response:
        """Requests without a body: epp answers the model listing itself."""
        method = self._headers.get(":method", "GET")
        path = self._headers.get(":path", "").split("?", 1)[0].rstrip("/")
        if method == "GET" and path.endswith("/v1/models"):
            REQUESTS.labels("", "models").inc()
            return responses.immediate(200, self._router.models_body())
        return self._refuse(
            errors.bad_request(
                f"{method} {path or '/'} has no body: epp routes OpenAI requests by the 'model' "
                "field of their JSON body (GET /v1/models is answered by epp)."
            )
        )

    def _refuse(self, error: RequestError) -> Response:
        REQUESTS.labels("", str(error.status)).inc()
        log.info("refused %s %s: %s", error.status, self._headers.get(":path", ""), error.message)
        return responses.error_response(error)


def _subset_hint(message: ext_proc_pb2.ProcessingRequest) -> list[str] | None:
    """The gateway's allowed endpoints (``envoy.lb.subset_hint``), or None when absent."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(responses.SUBSET_NAMESPACE)
    if namespace is None or responses.SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[responses.SUBSET_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return [a.strip() for a in value.string_value.split(",") if a.strip()]


def _present(headers: dict[str, str], names: Iterable[str]) -> list[str]:
    return [n for n in names if n in headers and n != responses.DESTINATION_HEADER]
