"""What one upstream response tells epp, read as it streams past: free of gRPC and of clocks.

The caller passes the time of each message (epp's clock when Envoy delivered it), so the
timings are those of the gateway: a token counts from the moment its chunk reached Envoy's
filter chain, which precedes the client's receipt by Envoy's own forwarding.

- Served endpoint: Envoy adds ``x-gateway-destination-endpoint-served: %UPSTREAM_HOST%`` to the
  response (route ``response_headers_to_add``), i.e. the host of the attempt that answered,
  after retries; a header_mutation filter strips it again before the client sees it. A GIE
  gateway that reports it as ``envoy.lb`` metadata instead is read too (the caller passes it).
- Time to first token: from the request's arrival at epp to the first SSE event that carries
  output (vLLM's role-only first chat chunk does not). Time per output token: from the first to
  the last token event over ``completion_tokens - 1``. Inter-token latency: the gaps between
  token events (vLLM merges tokens that piled up, so one gap may span several tokens).
- Usage: the JSON body's ``usage``, or the SSE event that carries it.

With ``strip_usage`` (epp asked for usage the client did not) the usage-only event is removed:
complete events are forwarded byte for byte, the unfinished tail is held until it completes.
"""

from __future__ import annotations

from collections.abc import Mapping

from epp.extproc.sse import SseDecoder
from epp.extproc.usage import carries_token, decode, is_usage_only, usage_of
from epp.lifecycle import Outcome, Usage
from epp.wire import SERVED

# A JSON body is parsed for its usage only up to this size; larger ones are passed unread.
MAX_JSON_BYTES = 8 * 1024 * 1024
# The response headers :meth:`ResponseObserver.on_headers` reads (the stream handler decodes
# no other header's value).
RESPONSE_HEADERS_READ = frozenset((SERVED, ":status", "content-length", "content-type"))


class ResponseObserver:
    """Consumes response headers and body chunks; :meth:`finish` yields the :class:`Outcome`."""

    __slots__ = (
        "_decoder",
        "_first",
        "_json",
        "_json_size",
        "_last",
        "_length",
        "_received",
        "_started",
        "_strip",
        "itl",
        "served",
        "status",
        "streamed",
        "usage",
    )

    def __init__(self, started: float, strip_usage: bool = False) -> None:
        self._started = started
        self._strip = strip_usage
        self.served: str | None = None
        self.status = 0
        self.streamed = False
        self.usage: Usage | None = None
        self.itl: list[float] = []
        self._decoder: SseDecoder | None = None
        self._json: list[bytes] | None = None
        self._json_size = 0
        self._first: float | None = None
        self._last: float | None = None
        # Declared Content-Length and body bytes seen: a body is whole when they meet, which
        # may be before Envoy's end-of-stream message (full duplex can close the stream first).
        self._length: int | None = None
        self._received = 0

    @property
    def first_token(self) -> float | None:
        """When the first token event arrived (the caller's clock), None before."""
        return self._first

    @property
    def body_complete(self) -> bool:
        """The body reached its declared Content-Length."""
        return self._length is not None and self._received >= self._length

    def on_headers(self, headers: Mapping[str, str], served: str | None = None) -> None:
        """``served``: the endpoint as a gateway reported it otherwise (GIE's metadata)."""
        self.served = served or headers.get(SERVED) or None
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        length = headers.get("content-length", "")
        if length.isdigit():
            self._length = int(length)
            # Removing an event would contradict the declared length: leave the body alone.
            self._strip = False
        content_type = headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            self.streamed = True
            self._decoder = SseDecoder()
        elif content_type.startswith("application/json"):
            self._json = []

    def on_body(self, chunk: bytes, now: float, end: bool = False) -> bytes | None:
        """Read one chunk (``end``: the last); returns the bytes to forward instead, or None
        to forward it as is."""
        self._received += len(chunk)
        if self._decoder is not None:
            return self._on_events(chunk, now, end)
        if self._json is not None and chunk:
            self._json_size += len(chunk)
            if self._json_size > MAX_JSON_BYTES:
                self._json = None
            else:
                self._json.append(chunk)
        return None

    def _on_events(self, chunk: bytes, now: float, end: bool) -> bytes | None:
        assert self._decoder is not None
        events = self._decoder.feed(chunk)
        kept: list[bytes] = []
        dropped = False
        for event in events:
            payload = decode(event.data) if event.data.startswith("{") else None
            if carries_token(payload):
                if self._first is None:
                    self._first = now
                elif self._last is not None:
                    self.itl.append(now - self._last)
                self._last = now
            usage = usage_of(payload)
            if usage is not None:
                self.usage = usage
                if self._strip and is_usage_only(payload):
                    dropped = True
                    continue
            if self._strip:
                kept.append(event.raw)
        if not self._strip:
            return None
        if end:
            # Whatever never completed as an event still belongs to the client.
            kept.append(self._decoder.pending())
        forward = b"".join(kept)
        if not dropped and forward == chunk:
            return None
        # Rewriting: forward complete events only; the unfinished tail follows with its end.
        return forward

    def finish(self, now: float, complete: bool) -> Outcome:
        """The response ended (``complete``) or the stream closed before it did."""
        if self._json:
            self.usage = usage_of(decode(b"".join(self._json)))
            self._json = None
        ttft = None if self._first is None else self._first - self._started
        tpot = None
        if self._first is not None and self._last is not None and self._last > self._first:
            tokens = self.usage.completion if self.usage else len(self.itl) + 1
            if tokens > 1:
                tpot = (self._last - self._first) / (tokens - 1)
        return Outcome(
            served=self.served,
            status=self.status,
            seconds=now - self._started,
            complete=complete,
            streamed=self.streamed,
            usage=self.usage,
            ttft=ttft,
            tpot=tpot,
            itl=self.itl,
        )
