"""The per-request state machine of one ext_proc stream, free of gRPC so it can be unit-tested.

Envoy sends request headers, then body chunks, then (with SEND trailer modes) trailers. epp
buffers the body to end of stream in both BUFFERED and FULL_DUPLEX_STREAMED modes, because the
routing decision needs the whole JSON body:

- BUFFERED: answer the headers at once with CONTINUE; the body arrives in one message and the
  routing answer rides on the body response (Envoy applies header mutations sent there).
- FULL_DUPLEX_STREAMED: Envoy does not wait for answers, so the headers answer is held back until
  the body is complete; then epp sends the routing headers answer and streams the body back.

Anything wrong with the request becomes an immediate response with an OpenAI-style error.

Responses stream past too (response headers, then body chunks: STREAMED after a buffered
request, FULL_DUPLEX_STREAMED after a full-duplex one, where each chunk must be echoed). A
:class:`~epp.extproc.response_stream.ResponseObserver` reads the endpoint that served, the
status, token timings and usage from them; when a retry served the request elsewhere than
epp picked, the pick's accounting moves there (:func:`~epp.state.moves.move_pick`). What a
complete response showed (metrics, passive health, the latency model) is recorded by
:meth:`StreamHandler.settle` once the answer to its last message is out, like the pick's
bookkeeping: neither delays an answer. When the response will end with usage and its endpoint
reports the engine's cached prompt tokens (vLLM's ``--enable-prompt-tokens-details``), the
latency model learns the TTFT only then, from the engine's uncached count
(:meth:`~epp.router.Router.responded`) rather than epp's estimate at the pick.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from epp import errors
from epp._proto import ext_proc_pb2, processing_mode_pb2
from epp.data_parallel import replica_of, routed
from epp.errors import RequestError
from epp.extproc import buffered, responses
from epp.extproc.response_stream import RESPONSE_HEADERS_READ, ResponseObserver
from epp.hooks.passive_health import judge_retry
from epp.lifecycle import Finished, Outcome, RequestContext
from epp.observability import (
    MOVED,
    OBJECTIVE_REQUESTS,
    REQUESTS,
    RESULTS,
    refusal_reason,
)
from epp.request import (
    InferenceRequest,
    api_for_path,
    check_headers,
    parse_decoded,
    set_engine_priority,
    too_deep,
)
from epp.rewrite import explained
from epp.router import Router
from epp.state.inflight import Ticket
from epp.state.moves import PickRecord, Recording, move_pick
from epp.wire import (
    CONTROL_HEADERS,
    DESTINATION,
    EXPLAIN,
    LB_NAMESPACE,
    OVERFLOW,
    SERVED,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
)

log = logging.getLogger("epp.extproc")
# APIs whose streaming requests accept ``stream_options.include_usage``.
_USAGE_OPTION_APIS = ("completions", "chat")

Response = ext_proc_pb2.ProcessingResponse
# Headers epp acts on, removed before the request goes upstream.
_REMOVED = (*CONTROL_HEADERS, EXPLAIN)
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass(frozen=True, slots=True)
class Pending:
    """A parsed request held until the servicer has awaited its preparation."""

    request: InferenceRequest
    # The body as it will be forwarded: the chunks received, or the rewritten body.
    chunks: Sequence[bytes]
    after: tuple[Response, ...]
    rewritten: bool


class StreamHandler:
    """Consumes one stream's ProcessingRequests and produces the ProcessingResponses to send."""

    __slots__ = (
        "_body",
        "_body_size",
        "_clock",
        "_deferred",
        "_done",
        "_full_duplex",
        "_held",
        "_observer",
        "_passing",
        "_response_ended",
        "_response_full_duplex",
        "_router",
        "context",
        "pending",
    )

    def __init__(self, router: Router, clock: Callable[[], float] = time.perf_counter) -> None:
        self._router = router
        # Latency timings read this clock when a message arrives (tests drive it by hand).
        self._clock = clock
        # What the request carries, starting with the configuration current as the stream
        # opens: kept to the stream's end whatever reloads.
        self.context = RequestContext(router.generation)
        self._body: list[bytes] = []
        self._body_size = 0
        # Body bytes counted in the process's buffered total (epp.extproc.buffered).
        self._held = 0
        self._full_duplex = False
        self._response_full_duplex = False
        self._done = False
        # A pass-through path (routing.passthrough), routed at the headers.
        self._passing = False
        # The pick's bookkeeping, run by settle() once the routing answer is out.
        self._deferred: list[Callable[[], None]] = []
        self._observer: ResponseObserver | None = None
        # When the response completed (the clock's time): what it showed is recorded by
        # settle(), after the answer.
        self._response_ended: float | None = None
        # A parsed request waiting for the servicer to await Router.prepare.
        self.pending: Pending | None = None

    @property
    def ticket(self) -> Ticket | None:
        pick = self.context.pick
        return None if pick is None else pick.ticket

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
            return self._on_response_headers(message)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "response_trailers":
            if self._response_ended is None:
                self._response_ended = self._clock()
            return (responses.CONTINUE_RESPONSE_TRAILERS,)
        return ()

    def _on_headers(self, message: ext_proc_pb2.ProcessingRequest) -> Sequence[Response]:
        context = self.context
        context.started = self._clock()
        headers = _read_headers(message.request_headers, context.headers)
        context.subset = _subset_hint(message)
        tracing = self._router.tracing
        if tracing is not None:
            context.trace = tracing.begin(headers)
        routing = context.generation.config.routing
        passthrough = routing.passthrough_pool(headers.get(":path", ""))
        if passthrough is not None:
            return self._pass_through(passthrough)
        if message.request_headers.end_of_stream:
            self._done = True
            return (self._header_only(),)
        refusal = check_headers(headers, routing.max_body_bytes)
        budget = context.generation.config.server.max_buffered_bytes
        declared = headers.get("content-length", "")
        if refusal is None and declared.isdigit() and not buffered.fits(int(declared), budget):
            refusal = buffered.overloaded(budget)
        if refusal is not None:
            self._done = True
            return (self._refuse(refusal),)
        if self._full_duplex:
            return ()
        return (responses.CONTINUE_REQUEST_HEADERS,)

    def _on_body(self, body: ext_proc_pb2.HttpBody) -> Sequence[Response]:
        if self._passing:
            # Routed at the headers: the body goes on unread (echoed, in full duplex).
            if self._full_duplex:
                return tuple(responses.body_chunks(body.body, body.end_of_stream))
            return (responses.CONTINUE_REQUEST_BODY,)
        if self._done:
            # Envoy may deliver the end-of-stream chunk twice for ~1 MB bodies: ignore repeats.
            return ()
        # Each read of a bytes field copies it out of the message: read the chunk once.
        chunk = body.body
        if chunk:
            self._body_size += len(chunk)
            limit = self.context.generation.config.routing.max_body_bytes
            if self._body_size > limit:
                return self._drop_body(errors.body_too_large(self._body_size, limit))
            budget = self.context.generation.config.server.max_buffered_bytes
            if not buffered.take(len(chunk), budget):
                return self._drop_body(buffered.overloaded(budget))
            self._held += len(chunk)
            self._body.append(chunk)
        if not body.end_of_stream:
            # BUFFERED_PARTIAL/STREAMED chunks are acknowledged; full duplex expects no answer.
            return () if self._full_duplex else (responses.CONTINUE_REQUEST_BODY,)
        return self._complete()

    def _drop_body(self, error: RequestError) -> Sequence[Response]:
        self._done = True
        self._body.clear()
        self._release()
        return (self._refuse(error),)

    def _release(self) -> None:
        """Give the body's bytes back to the process's buffered total."""
        buffered.give(self._held)
        self._held = 0

    def _on_trailers(self) -> Sequence[Response]:
        # Full duplex with trailers: the body ended without an end_of_stream chunk.
        if not self._done and self._full_duplex:
            return self._complete(after=(responses.CONTINUE_REQUEST_TRAILERS,))
        return (responses.CONTINUE_REQUEST_TRAILERS,)

    def _on_response_headers(self, message: ext_proc_pb2.ProcessingRequest) -> Sequence[Response]:
        context = self.context
        headers = _read_headers(message.response_headers, {}, RESPONSE_HEADERS_READ)
        observer = self._observer = ResponseObserver(context.started, context.strip_usage)
        observer.on_headers(headers, _served_metadata(message))
        served = observer.served
        pick = context.pick
        if pick is not None and served == replica_of(self._router.config.ranks, pick.endpoint):
            served = observer.served = pick.endpoint  # a rank: Envoy names its replica
        if (
            pick is not None
            and context.spilled is None
            and served is not None
            and served != pick.endpoint
        ):
            # Envoy retried: the work, the prefix blocks and the session are on `served`, and
            # the picked endpoint failed an attempt, unless it joined so recently that Envoy
            # may not have resolved it: override_host then skips it without trying it, and
            # counting that against it ejected fresh replicas right after a scale-up.
            now = time.time()
            fleet = self._router.fleet
            if not self._router.settling.settling(pick.endpoint):
                judge_retry(fleet.health, self._router.config.pools, pick.endpoint, now)
            context.pick = move_pick(fleet, pick, served, now)
            MOVED.inc()
        if served is not None:
            self._router.settling.served(served)
        if context.trace is not None:
            context.trace.response_started = time.perf_counter()
        if message.response_headers.end_of_stream:
            self._response_ended = self._clock()
        charge = context.charge
        if charge is not None and charge.headers:
            return (responses.add_response_headers(charge.headers),)
        return (responses.CONTINUE_RESPONSE_HEADERS,)

    def _on_response_body(self, body: ext_proc_pb2.HttpBody) -> Sequence[Response]:
        observer = self._observer
        forward = None
        chunk = body.body  # one read: each copies the bytes out of the message
        end = body.end_of_stream
        if observer is not None:
            now = self._clock()
            forward = observer.on_body(chunk, now, end)
            first = observer.first_token
            pick = self.context.pick
            if first is not None and pick is not None and pick.ticket.waiting:
                self._router.learning.first_token(pick, first, self.context.usage_expected)
            if end or observer.body_complete:
                self._response_ended = now
        if not self._response_full_duplex:
            if forward is None:
                return (responses.CONTINUE_RESPONSE_BODY,)
            return (responses.replace_response_body(forward),)
        # Full-duplex responses must be echoed chunk by chunk (an empty one still carries the
        # end of stream).
        return tuple(
            responses.body_chunks(chunk if forward is None else forward, end, response=True)
        )

    def settle(self) -> None:
        """Run the bookkeeping held back from the answers: the pick's (post-pick hooks: prefix
        index insertions, session binding, what they learned recorded in :attr:`pick`), and
        once the response is complete, what it showed (:meth:`close`). The servicer calls it
        once the answers of a message are sent; idempotent."""
        if self._response_ended is not None:
            self.close(complete=True, at=self._response_ended)
        if self._held and self._done and self.pending is None:
            self._release()  # the routing answer (or refusal) carrying the body is out
        if not self._deferred:  # called after every message: most have nothing held back
            return
        work, self._deferred = self._deferred, []
        with Recording(self._router.fleet.states) as learned:
            for task in work:
                try:
                    task()
                except Exception:
                    # What later decisions would have learned is lost; this request is not.
                    log.exception("post-pick bookkeeping failed")
        if self.context.pick is not None:
            self.context.pick.learned.extend(learned)

    def close(self, complete: bool = False, at: float | None = None) -> None:
        """The response ended (``complete``, ``at`` the clock's time, default now) or its
        stream closed: record what it showed. Idempotent; the servicer calls it when the stream
        ends for any reason."""
        self._release()  # the stream ended: whatever it still held is gone with it
        observer = self._observer
        request = self.context.request
        if observer is None or request is None:
            return
        self._observer = None
        outcome = observer.finish(self._clock() if at is None else at, complete)
        self._router.lifecycle.finished(Finished(self.context, request, outcome, request.objective))
        if self.context.trace is not None:
            self.context.trace.responded(outcome.status, outcome.served, _span_attributes(outcome))

    def end_trace(self) -> None:
        """The stream is over: build and export the request's spans (when traced). Called
        by the servicer after the last answer went out, so it never delays one."""
        trace = self.context.trace
        if trace is not None:
            self.context.trace = None
            trace.end()

    def _complete(self, after: Sequence[Response] = ()) -> Sequence[Response]:
        """The body is whole: parse it, then route now, or hold it in :attr:`pending` when the
        profile has preparation to await first or flow control may hold it (the servicer awaits
        both, then calls :meth:`resume` or :meth:`refuse_pending`); until then the stream is
        simply not answered. ``after`` follows the routing answer."""
        self._done = True
        # The chunks as they arrived are what a full-duplex answer streams back (no copies);
        # joined for parsing (one chunk, always so when buffered, is the body itself).
        chunks, self._body = self._body, []
        body = b"".join(chunks)
        headers = self.context.headers
        trace = self.context.trace
        started = time.perf_counter() if trace is not None else 0.0
        try:
            gen = self.context.generation
            request, data = parse_decoded(
                headers.get(":path", ""), headers, body, gen.config.request, gen.models
            )
            rewritten = self._rewrite_body(request, data)
        except RequestError as error:
            if trace is not None:
                trace.step("epp.parse", started, {"epp.body_bytes": len(body)}, error.message)
            return (self._refuse(error), *after)
        if trace is not None:
            trace.attributes["gen_ai.request.model"] = request.model
            trace.attributes["epp.request_id"] = request.request_id
            trace.step(
                "epp.parse",
                started,
                {
                    "epp.body_bytes": len(body),
                    "epp.request.stream": request.stream,
                    "epp.prompt_tokens_estimate": request.prompt_tokens(),
                },
            )
        if rewritten is not None:
            chunks = [rewritten]
        if self.context.generation.needs_preparation:
            self.pending = Pending(request, chunks, tuple(after), rewritten is not None)
            return ()
        return self._route(request, chunks, after, rewritten is not None)

    def _rewrite_body(self, request: InferenceRequest, data: dict[str, Any]) -> bytes | None:
        """The body to forward instead of the client's, or None to forward it unchanged: one
        re-serialisation for every change epp makes (the model rewrite, the engine priority, the
        usage option)."""
        policy = self.context.generation.config.request
        renamed = self._rename(request, data)
        changed = policy.engine_priority and set_engine_priority(request, data)
        asked_usage = self._ask_for_usage(request, data)
        self.context.usage_expected = _expects_usage(request, data)
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
        self.context.strip_usage = asked_usage
        return rewritten

    def _rename(self, request: InferenceRequest, data: dict[str, Any]) -> bool:
        """Apply the model rewrite that matches (epp.rewrite): the request is scheduled, and
        the body forwarded, with the target model; True when ``data`` changed."""
        rewrite = self.context.generation.rewrites.choose(request.model, request.session)
        self.context.rewrite = rewrite
        if rewrite is None or rewrite.target == request.model:
            return False
        request.model = data["model"] = rewrite.target
        return True

    def _ask_for_usage(self, request: InferenceRequest, data: dict[str, Any]) -> bool:
        """With ``routing.inject_stream_usage``, a streaming request that did not ask for
        usage gets ``stream_options.include_usage`` (True when ``data`` was changed) and the
        usage chunk it brings is later removed from what the client receives."""
        if not (
            self.context.generation.config.routing.inject_stream_usage
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

    def refuse_pending(self, error: RequestError) -> Sequence[Response]:
        """The :attr:`pending` request was refused while held (flow control: queue full, TTL)."""
        pending = self.pending
        self.pending = None
        return (self._refuse(error), *(() if pending is None else pending.after))

    def resume(self) -> Sequence[Response]:
        """Route the :attr:`pending` request, once its preparation has been awaited."""
        pending = self.pending
        if pending is None:
            return ()
        self.pending = None
        return self._route(pending.request, pending.chunks, pending.after, pending.rewritten)

    def _route(
        self,
        request: InferenceRequest,
        chunks: Sequence[bytes],
        after: Sequence[Response],
        rewritten: bool,
    ) -> Sequence[Response]:
        """Pick; the answer carries the body's ``chunks`` back in full-duplex mode, and the
        rewritten body (the only chunk then) in buffered mode."""
        overflow = self._router.spill_target(request, self.context.generation)
        if overflow is not None:
            return self._spill(request, chunks, after, rewritten, overflow)
        fleet = self._router.fleet
        trace = self.context.trace
        started = time.perf_counter() if trace is not None else 0.0
        try:
            decision, ticket = self._router.route(
                request,
                self.context.subset,
                None if trace is None else trace.laps,
                self._deferred,
                self.context.generation,
                self.context.rewrite,
            )
        except RequestError as error:
            if trace is not None:
                trace.step("epp.schedule", started, self._profile_attributes(), error.message)
            if self.context.charge is not None:  # never ran: its tenant's budget is given back
                self._router.budgets.refund(self.context.charge)
                self.context.charge = None
            return (self._refuse(error), *after)
        if trace is not None:
            endpoints = [e.address for e in decision.endpoints]
            trace.attributes["epp.endpoint"] = endpoints[0]
            trace.step(
                "epp.schedule",
                started,
                {**self._profile_attributes(), "epp.endpoints": endpoints},
            )
        ahead = ticket.basis.prefill_ahead if ticket.basis is not None else ticket.prefill
        self.context.pick = PickRecord(ticket, picked_at=self._clock(), prefill_ahead=ahead)
        fleet.health.picked(ticket.endpoint, time.time())  # a half-open circuit's trial
        self.context.request = request
        OBJECTIVE_REQUESTS.add((self.context.requested_label(), request.model))
        # Envoy knows replicas: a data-parallel rank is named in a header (epp.data_parallel).
        destination, extra = routed(self._router.config.ranks, decision.endpoints)
        remove = _present(self.context.headers, _REMOVED)
        if decision.prefill is not None:
            extra = ((decision.prefill_header, decision.prefill.address), *extra)
        # Set, not also removed: Envoy applies removals after sets.
        remove = [h for h in remove if h not in dict(extra)]
        scores = None
        config = self.context.generation.config
        if decision.scores is not None and config.routing.explains_to(
            self.context.headers.get(EXPLAIN), config.server.debug_token
        ):
            shown = explained(decision.scores, self.context.rewrite)
            scores = json.dumps(shown, separators=(",", ":"), sort_keys=True)
        if self._full_duplex:
            size = sum(map(len, chunks))
            return (
                responses.route_in_headers(destination, remove, size, scores, extra=extra),
                *responses.stream_back(chunks),
                *after,
            )
        body_out = chunks[0] if rewritten else None
        return (
            responses.route_in_body(destination, remove, scores, body_out, extra=extra),
            *after,
        )

    def _profile_attributes(self) -> dict[str, str]:
        return {"epp.profile": self.context.generation.config.scheduling.profile}

    def _spill(
        self,
        request: InferenceRequest,
        chunks: Sequence[bytes],
        after: Sequence[Response],
        rewritten: bool,
        overflow: str,
    ) -> Sequence[Response]:
        """Send the request to overflow pool ``overflow`` (its home pool is saturated)."""
        self.context.pick = PickRecord(self._router.spill(request, overflow))
        self.context.spilled = overflow
        self.context.request = request
        remove = [h for h in _present(self.context.headers, _REMOVED) if h != OVERFLOW]
        if self._full_duplex:
            size = sum(map(len, chunks))
            return (
                responses.route_in_headers("", remove, size, overflow=overflow),
                *responses.stream_back(chunks),
                *after,
            )
        body_out = chunks[0] if rewritten else None
        return (responses.route_in_body("", remove, body=body_out, overflow=overflow), *after)

    def _pass_through(self, pool: str) -> Sequence[Response]:
        """A path ``routing.passthrough`` sends to ``pool``: no inference request, so no
        parse, admission or scoring; the least loaded ready replica, chosen at the headers."""
        self._done = True
        try:
            ticket = self._router.pass_through(pool, self.context.headers.get(":path", ""))
        except RequestError as error:
            return (self._refuse(error),)
        self.context.pick = PickRecord(ticket)
        self._passing = True
        remove = _present(self.context.headers, _REMOVED)
        return (responses.route_in_headers(ticket.endpoint, remove, None),)

    def _header_only(self) -> Response:
        """Requests without a body: epp answers the model listing itself."""
        method = self.context.headers.get(":method", "GET")
        path = self.context.headers.get(":path", "").split("?", 1)[0]
        if method == "GET" and path == "/v1/models":  # exactly, as api_for_path matches
            REQUESTS.add(("", "models"))
            RESULTS.add(("ok",))
            if self.context.trace is not None:
                self.context.trace.answered(200)
            return responses.immediate(200, self._router.models_body())
        return self._refuse(
            errors.bad_request(
                f"{method} {path or '/'} has no body: epp routes OpenAI requests by the 'model' "
                "field of their JSON body (GET /v1/models is answered by epp)."
            )
            if api_for_path(path) is not None
            else errors.unknown_path(method, path)
        )

    def _refuse(self, error: RequestError) -> Response:
        if self.context.trace is not None:
            self.context.trace.answered(error.status, error.message)
        REQUESTS.add(("", str(error.status)))
        RESULTS.add((refusal_reason(error.status, error.code),))
        path = self.context.headers.get(":path", "")
        log.info("refused %s %s: %s", error.status, path, error.message)
        return responses.error_response(error)


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


def _span_attributes(outcome: Outcome) -> dict[str, object]:
    """What a traced response's span shows (epp.tracing)."""
    attributes: dict[str, object] = {
        "http.response.status_code": outcome.status,
        "epp.response.complete": outcome.complete,
        "epp.response.streamed": outcome.streamed,
    }
    optional = {
        "epp.served_endpoint": outcome.served,
        "epp.ttft_seconds": outcome.ttft,
        "epp.tpot_seconds": outcome.tpot,
    }
    usage = outcome.usage
    if usage is not None:
        optional["gen_ai.usage.input_tokens"] = usage.prompt
        optional["gen_ai.usage.output_tokens"] = usage.completion
        optional["epp.usage.cached_tokens"] = usage.cached
    attributes.update((k, v) for k, v in optional.items() if v is not None)
    return attributes


def _read_headers(
    message: ext_proc_pb2.HttpHeaders, into: dict[str, str], only: frozenset[str] | None = None
) -> dict[str, str]:
    """The headers of ``message`` (``only``: just those, the others' values left unread)."""
    for h in message.headers.headers:
        key = h.key
        if only is not None and key not in only:
            continue
        raw = h.raw_value  # each read copies the bytes out of the message
        into[key] = raw.decode("utf-8", "replace") if raw else h.value
    return into


def _served_metadata(message: ext_proc_pb2.ProcessingRequest) -> str | None:
    """The served endpoint as GIE gateways report it (``envoy.lb`` metadata), or None."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    # GIE names the metadata key like the header.
    if namespace is None or SERVED not in namespace.fields:
        return None
    return namespace.fields[SERVED].string_value or None


def _subset_hint(message: ext_proc_pb2.ProcessingRequest) -> list[str] | None:
    """The gateway's allowed endpoints (``envoy.lb.subset_hint``), or None when absent."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if namespace is None or SUBSET_HINT_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_HINT_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return [a.strip() for a in value.string_value.split(",") if a.strip()]


def _present(headers: dict[str, str], names: Iterable[str]) -> list[str]:
    return [n for n in names if n in headers and n != DESTINATION]
