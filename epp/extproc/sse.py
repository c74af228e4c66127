"""Incremental server-sent-events decoding for responses that arrive in arbitrary chunks.

Envoy hands epp the response body as the upstream's TCP reads delivered it: an event may be
split anywhere, even inside a line or a multi-byte UTF-8 character, and one chunk may carry
several events. :class:`SseDecoder` keeps the unfinished tail between chunks and yields each
event once its terminating blank line has arrived, as the SSE specification (WHATWG HTML,
"event stream interpretation") dispatches it: ``data`` lines joined with ``\\n``; lines end in
``\\n``, ``\\r\\n`` or ``\\r``; comment lines (``:``) and other fields are ignored.

Every event also carries its raw bytes (terminator included), so a caller that drops one event
(epp's injected usage chunk) can forward the others byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

# An event without a terminating blank line is held at most this long; a stream that sends a
# larger one is not SSE as vLLM writes it, and decoding stops rather than buffering forever.
MAX_EVENT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Event:
    data: str
    raw: bytes


class SseDecoder:
    """Feed chunks, get complete events; see the module docstring."""

    __slots__ = ("_pending", "overflowed")

    def __init__(self) -> None:
        self._pending = b""
        # True once an event outgrew MAX_EVENT_BYTES; the decoder then yields nothing more.
        self.overflowed = False

    def feed(self, chunk: bytes) -> list[Event]:
        if self.overflowed:
            return []
        if not self._pending and _whole_event(chunk):
            # The common case (vLLM writes one event a chunk): nothing to split or hold.
            return [Event(_data(chunk), chunk)]
        buffer = self._pending + chunk if self._pending else chunk
        events: list[Event] = []
        start = 0
        while True:
            end = _event_end(buffer, start)
            if end < 0:
                break
            raw = buffer[start:end]
            events.append(Event(_data(raw), raw))
            start = end
        self._pending = buffer[start:]
        if len(self._pending) > MAX_EVENT_BYTES:
            self.overflowed = True
            self._pending = b""
        return events

    def pending(self) -> bytes:
        """Bytes of the event not yet complete (held back by a caller that rewrites)."""
        return self._pending


def _event_end(buffer: bytes, start: int) -> int:
    """Index just past the blank line that ends the event starting at ``start``, or -1.

    A trailing ``\\r`` is not taken as a terminator yet: the next chunk may start with ``\\n``.
    """
    i = start
    n = len(buffer)
    while i < n:
        cr = buffer.find(b"\r", i)
        lf = buffer.find(b"\n", i)
        if cr < 0 and lf < 0:
            return -1
        if cr < 0 or (0 <= lf < cr):
            eol = lf + 1
        elif cr + 1 < n:
            eol = cr + 2 if buffer[cr + 1] == 0x0A else cr + 1
        else:
            return -1  # lone \r at the end: wait for the byte after it
        # A line that is empty (the terminator right at the line start) ends the event.
        if eol - i <= 2 and buffer[i:eol] in (b"\n", b"\r\n", b"\r"):
            if i == start:
                # Blank lines between events: consume and keep looking for the next event.
                start = i = eol
                continue
            return eol
        i = eol
    return -1


def _whole_event(chunk: bytes) -> bool:
    """``chunk`` is exactly one event in ``\\n`` line endings: its first blank line ends it."""
    return chunk.find(b"\n\n") == len(chunk) - 2 > 0 and b"\r" not in chunk


def _data(raw: bytes) -> str:
    if raw.startswith(b"data: ") and raw.find(b"\n") == len(raw) - 2 and b"\r" not in raw:
        return raw[6:-2].decode("utf-8", "replace")  # one data line, as vLLM writes events
    lines = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    data: list[str] = []
    for line in lines:
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            data.append(value.decode("utf-8", "replace"))
        elif line == b"data":
            data.append("")
    return "\n".join(data)
