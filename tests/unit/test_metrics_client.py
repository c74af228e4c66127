"""The scraper's HTTP/1.1 client against a real TCP server on 127.0.0.1 whose answers (framing,
keep-alive, status) each test writes byte for byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from epp.sources.metrics_client import MetricsConnection

PAGE = b'vllm:num_requests_running{engine="0"} 3.0\n'


def _sized(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


class RawServer:
    """Answers each request read on a connection with ``answer()``; counts connections and
    requests; with ``close_after_answer`` it closes every connection once it has answered."""

    def __init__(self) -> None:
        self.answer: Callable[[], bytes] = lambda: _sized(PAGE)
        self.close_after_answer = False
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(request)
                writer.write(self.answer())
                await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw() -> AsyncIterator[RawServer]:
    server = RawServer()
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = listening.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listening.close()


async def test_one_kept_alive_connection_serves_every_fetch(raw: RawServer) -> None:
    client = MetricsConnection(f"127.0.0.1:{raw.port}")
    try:
        for _ in range(5):
            assert await client.fetch() == PAGE
    finally:
        client.close()
    assert raw.connections == 1
    assert len(raw.requests) == 5
    first = raw.requests[0].decode()
    assert first.startswith("GET /metrics HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{raw.port}\r\n" in first
    assert "Accept-Encoding: identity\r\n" in first


async def test_chunked_and_to_the_end_bodies(raw: RawServer) -> None:
    client = MetricsConnection(f"127.0.0.1:{raw.port}")
    try:
        raw.answer = lambda: (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"5\r\nvllm:\r\n"
            + f"{len(PAGE) - 5:x};ext=1\r\n".encode()
            + PAGE[5:]
            + b"\r\n0\r\n\r\n"
        )
        assert await client.fetch() == PAGE
        assert await client.fetch() == PAGE  # the chunked answer left the connection usable
        assert raw.connections == 1
        # No length: the body runs to the end of the connection, which is then not reused.
        raw.answer = lambda: b"HTTP/1.0 200 OK\r\n\r\n" + PAGE
        raw.close_after_answer = True
        assert await client.fetch() == PAGE
        raw.answer = lambda: _sized(PAGE)
        assert await client.fetch() == PAGE
        assert raw.connections == 2  # the first one, closed after the body without a length
    finally:
        client.close()


async def test_a_connection_the_server_closed_is_replaced(raw: RawServer) -> None:
    """A replica's keep-alive timeout may close the connection between two scrapes: the next
    fetch still succeeds, on a new connection."""
    raw.close_after_answer = True
    client = MetricsConnection(f"127.0.0.1:{raw.port}")
    try:
        for _ in range(3):
            assert await client.fetch() == PAGE
            await asyncio.sleep(0.05)  # the server's close reaches us
    finally:
        client.close()
    assert raw.connections == 3


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy", "HTTP 503"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.x answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 12x\r\n\r\n", "bad Content-Length"),
    ],
)
async def test_bad_answers_raise_and_the_next_fetch_starts_afresh(
    raw: RawServer, answer: bytes, error: str
) -> None:
    client = MetricsConnection(f"127.0.0.1:{raw.port}")
    raw.answer = lambda: answer
    try:
        with pytest.raises(ValueError, match=error):
            await client.fetch()
        raw.answer = lambda: _sized(PAGE)
        assert await client.fetch() == PAGE
    finally:
        client.close()
    assert raw.connections == 2


async def test_nothing_listening_raises() -> None:
    listening = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    listening.close()
    await listening.wait_closed()
    client = MetricsConnection(f"127.0.0.1:{port}")
    with pytest.raises(ConnectionRefusedError):
        await client.fetch()


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:http", ":8000"])
async def test_a_malformed_address_fails_each_fetch(address: str) -> None:
    client = MetricsConnection(address)
    with pytest.raises(ValueError, match="not host:port"):
        await client.fetch()
