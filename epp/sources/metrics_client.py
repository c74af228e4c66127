"""A minimal HTTP/1.1 keep-alive client for one replica's ``/metrics`` page.

The scraper fetches every replica's page twenty times a second, for as long as epp runs, and
nothing else; a general client pays per fetch for what this one never needs (cookie jars, URL
objects, redirects, connection pools, header multidicts): with aiohttp, epp with three replicas
and no traffic spent several percent of a core on scraping. This client keeps
one connection per replica (owned by that replica's scrape task, so never shared), writes one
fixed request and reads the answer by its ``Content-Length`` (or chunked, or to the end of the
connection): the answer's bytes, or an exception, which closes the connection so that the next
fetch starts on a fresh one.
"""

from __future__ import annotations

import asyncio
import ssl

# The longest status line plus headers accepted; a metrics server's are a few hundred bytes.
_MAX_HEAD = 64 * 1024


class MetricsConnection:
    """Fetches ``/metrics`` from ``address`` (``host:port``, ``[v6]:port``) over one
    kept-alive connection, opened on first use and reopened after any failure."""

    __slots__ = ("_host", "_port", "_reader", "_request", "_tls", "_writer")

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._host = host.strip("[]")
        # A malformed address fails each fetch (a failed scrape), like an unreachable one.
        self._port = int(port) if port.isdigit() else None
        # Classic text format, uncompressed: on a LAN, gzip would cost the replica's API server
        # CPU (its event loop compresses every page) to save bandwidth we do not lack.
        self._request = (
            f"GET /metrics HTTP/1.1\r\nHost: {address}\r\nAccept: text/plain\r\n"
            "Accept-Encoding: identity\r\nUser-Agent: epp\r\n\r\n"
        ).encode("ascii")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        # What the open connection was made with: a reload's new context (renewed
        # certificates) or the switch to or from TLS takes effect on the next fetch.
        self._tls: tuple[ssl.SSLContext, str | None] | None = None

    async def fetch(self, tls: tuple[ssl.SSLContext, str | None] | None = None) -> bytes:
        """The page's body; raises on a connection failure, a malformed answer or a status
        other than 200. ``tls``: (context, server name to verify; default the host), used when
        a connection is opened. The caller bounds the time (``asyncio.timeout``): a
        cancellation closes the connection, whose state is then unknown."""
        try:
            return await self._fetch(tls)
        except BaseException:
            self.close()
            raise

    async def _fetch(self, tls: tuple[ssl.SSLContext, str | None] | None) -> bytes:
        if tls is not self._tls:
            self.close()
            self._tls = tls
        if self._writer is not None and not self._writer.is_closing():
            try:
                return await self._exchange()
            except (ConnectionError, asyncio.IncompleteReadError):
                # The replica may have closed the idle connection (its keep-alive timeout ran
                # out between two scrapes): once more, on a new connection.
                self.close()
        if self._port is None or not self._host:
            raise ValueError("the endpoint address is not host:port")
        if tls is None:
            opened = await asyncio.open_connection(self._host, self._port, limit=_MAX_HEAD)
        else:
            opened = await asyncio.open_connection(
                self._host,
                self._port,
                ssl=tls[0],
                server_hostname=tls[1] or self._host,
                limit=_MAX_HEAD,
            )
        self._reader, self._writer = opened
        return await self._exchange()

    async def _exchange(self) -> bytes:
        reader, writer = self._reader, self._writer
        assert reader is not None
        assert writer is not None
        writer.write(self._request)
        head = await reader.readuntil(b"\r\n\r\n")
        status, length, chunked, keep = _parse_head(head)
        if chunked:
            body = await _read_chunked(reader)
        elif length is not None:
            body = await reader.readexactly(length)
        else:
            body = await reader.read()  # HTTP/1.0 style: the body runs to the end
            keep = False
        if not keep:
            self.close()
        if status != 200:
            raise ValueError(f"HTTP {status}")
        return body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


def _parse_head(head: bytes) -> tuple[int, int | None, bool, bool]:
    """Status, Content-Length, whether chunked, whether the connection stays open."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ValueError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    length = None
    chunked = False
    keep = version == "HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        value = value.strip()
        if name == "content-length":
            if not value.isdigit():
                raise ValueError(f"bad Content-Length {value[:40]!r}")
            length = int(value)
        elif name == "transfer-encoding":
            chunked = value.lower().endswith("chunked")
        elif name == "connection":
            keep = value.lower() == "keep-alive" or (keep and value.lower() != "close")
    return int(code), length, chunked, keep


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"x", 16)
        if size == 0:
            # Trailers (none expected) up to the empty line that ends the message.
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
