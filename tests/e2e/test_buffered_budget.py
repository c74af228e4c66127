"""server.max_buffered_bytes through the real Envoy: while one upload holds most of epp's
budget, another body is refused with epp's 503 JSON, and fits again once the first is gone.

Full-duplex mode: Envoy streams body chunks to epp as they arrive, so an upload that is still
being sent is held in epp (in buffered mode Envoy holds it until it is complete)."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator

import pytest

from epp.devstack import Stack
from tests.e2e.client import metric_values
from tests.e2e.conftest import serve_stack
from tests.e2e.fleet import wait_until

BUDGET = 1_000_000
HELD = 900_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from serve_stack(
        tmp_path_factory,
        "buffered-budget",
        "full-duplex",
        replicas=1,
        config_extra={"server": {"max_buffered_bytes": BUDGET}},
    )


def _held(stack: Stack) -> float:
    url = f"http://127.0.0.1:{stack.epp_ports[0][2]}/metrics"
    return sum(metric_values(url, "epp_buffered_request_bytes").values())


def _post(stack: Stack, prompt_bytes: int) -> tuple[int, bytes]:
    host, port = stack.url.removeprefix("http://").split(":")
    body = json.dumps({"model": stack.model, "prompt": "x" * prompt_bytes, "max_tokens": 1})
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        # Chunked, no Content-Length: the budget is checked as the chunks arrive.
        conn.request(
            "POST",
            "/v1/completions",
            iter([body.encode()]),
            {"content-type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_body_beyond_the_budget_gets_503_json_until_room_frees(stack: Stack) -> None:
    host, port = stack.url.removeprefix("http://").split(":")
    upload = socket.create_connection((host, int(port)), timeout=30)
    try:
        upload.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: epp\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + f"{HELD:x}\r\n".encode()
            + b'{"model": "tiny", "prompt": "'.ljust(HELD, b"x")
            + b"\r\n"
        )
        wait_until(lambda: _held(stack) >= HELD, 10, "epp holds the unfinished upload")
        status, body = _post(stack, 150_000)  # over the 100 KB left
        assert status == 503, body[:300]
        error = json.loads(body)["error"]
        assert error["code"] == "buffer_full"
        assert "server.max_buffered_bytes" in error["message"]
    finally:
        upload.close()
    wait_until(lambda: _held(stack) == 0, 10, "the abandoned upload's bytes given back")
    # The same body now goes through epp to the replica (which may find the prompt too long
    # for its context: its own 400, not epp's 503).
    status, body = _post(stack, 150_000)
    assert status != 503, body[:300]
    assert b"buffer_full" not in body
