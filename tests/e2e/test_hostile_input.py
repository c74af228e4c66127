"""Hostile input through the real Envoy, in both body modes: every case gets its 4xx (or 200
for the controls) with an OpenAI-style JSON error body, and no refused request reaches a replica.

Cases are sent over raw sockets where ordinary clients refuse to send them (control characters
in headers, bodies that end early, oversized headers) and where timing matters (an oversized
body: the client reads while it sends, as curl does). docs/hostile-input.md lists the cases
and what a client sees for each.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from epp.devstack import Stack
from tests.e2e.conftest import BODY_MODES, serve_stack

LIMIT = 1024 * 1024  # routing.max_body_bytes of these stacks


@pytest.fixture(scope="module", params=BODY_MODES)
def hostile(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from serve_stack(
        tmp_path_factory,
        "hostile",
        request.param,
        replicas=1,
        # Trusted identity headers, so that a malformed one reaches epp (by default Envoy
        # strips them before epp sees them).
        config_extra={"routing": {"max_body_bytes": LIMIT}, "request": {"trusted_headers": True}},
    )


@dataclass
class Raw:
    status: int
    headers: dict[str, str]
    body: bytes


def _read_response(sock: socket.socket, deadline: float) -> Raw:
    """One final HTTP/1.1 response (1xx interim answers skipped), body by Content-Length."""
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            data += _recv(sock, deadline)
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        if status >= 200:
            break
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(data) < length:
        data += _recv(sock, deadline)
    return Raw(status, headers, data[:length])


def _recv(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("connection closed before a complete response")
    return chunk


def exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 15.0) -> Raw:
    """Send ``head`` then ``body`` while watching for an early answer, as curl does: a server
    that refuses mid-body is heard instead of the client blocking on a full socket."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        view = memoryview(body)
        while view and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                break
            if writable:
                try:
                    sent = sock.send(view[:65536])
                except (BrokenPipeError, ConnectionResetError):
                    break
                view = view[sent:]
        return _read_response(sock, deadline)


def post(
    path: str, body: bytes, content_type: str | None = "application/json", **extra: str
) -> bytes:
    headers = {"host": "epp.test", "content-length": str(len(body)), **extra}
    if content_type is not None:
        headers["content-type"] = content_type
    lines = [f"POST {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    inner = '{"a":1}' if open_ == "[" else "1"
    opener = open_ if open_ == "[" else '{"a":'
    return opener * depth + inner + close * depth


def doc(**fields: object) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1, **fields}).encode()


def chat(messages: str) -> bytes:
    return b'{"model": "tiny", "max_tokens": 1, "messages": ' + messages.encode() + b"}"


@dataclass(frozen=True)
class Case:
    """One request (head + body, raw bytes) and the status epp or Envoy must answer."""

    name: str
    status: int
    head: bytes
    body: bytes = b""

    @classmethod
    def body_case(
        cls, name: str, status: int, body: bytes, path: str = "/v1/completions", **kw: str
    ) -> Case:
        content_type = kw.pop("content_type", "application/json")
        return cls(name, status, post(path, body, content_type or None, **kw), body)


C = Case.body_case
VALID = doc()
DEEP = 100_000

CASES = [
    # Controls: ordinary and unusual-but-valid requests are served.
    C("valid-completion", 200, VALID),
    C("valid-chat", 200, chat('[{"role": "user", "content": "hi"}]'), "/v1/chat/completions"),
    C("nesting-64-in-extra-field", 200, doc()[:-1] + b', "extra": ' + nested(64).encode() + b"}"),
    C("no-content-type", 200, VALID, content_type=""),
    C("json-charset-content-type", 200, VALID, content_type="application/json; charset=utf-8"),
    C("unicode-prompt", 200, doc(prompt="h\u00e9llo \u4e16\u754c \U0001f600")),
    # Bodies that are not JSON objects.
    C("malformed-json", 400, b"{not json"),
    C("truncated-json", 400, VALID[: len(VALID) // 2]),
    C("empty-body", 400, b""),
    C("body-is-array", 400, b"[1, 2, 3]"),
    C("body-is-string", 400, b'"hello"'),
    C("body-is-number", 400, b"42"),
    C("body-is-null", 400, b"null"),
    C("invalid-utf8", 400, b'{"model": "tiny", "prompt": "\xff\xfe\xc3("}'),
    C("lone-surrogate", 400, b'{"model": "tiny", "prompt": "a\\ud800b"}'),
    C("raw-control-char-in-string", 400, b'{"model": "tiny", "prompt": "a\x00b"}'),
    C("trailing-garbage", 400, VALID + b"}{"),
    # Deep nesting, wherever it sits.
    C("deep-array-top-level", 400, nested(DEEP).encode()),
    C("deep-object-in-field", 400, doc()[:-1] + b', "extra": ' + nested(DEEP, "{").encode() + b"}"),
    C("deep-array-in-prompt", 400, b'{"model": "tiny", "prompt": ' + nested(DEEP).encode() + b"}"),
    C(
        "deep-in-chat-content",
        400,
        chat('[{"role": "user", "content": [' + nested(DEEP, "{") + "]}]"),
        "/v1/chat/completions",
    ),
    C("deep-before-model", 400, b'{"x": ' + nested(DEEP).encode() + b', "model": "tiny"}'),
    # Numbers and literals JSON does not define.
    C("nan-literal", 400, b'{"model": "tiny", "prompt": "x", "temperature": NaN}'),
    C("infinity-literal", 400, b'{"model": "tiny", "prompt": "x", "temperature": Infinity}'),
    C("minus-infinity", 400, b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}'),
    C("float-overflow", 400, b'{"model": "tiny", "prompt": "x", "temperature": 1e999}'),
    C(
        "huge-integer",
        400,
        b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    ),
    C("duplicate-model-key", 400, b'{"model": "tiny", "prompt": "x", "model": "other"}'),
    C(
        "duplicate-nested-key",
        400,
        chat('[{"role": "user", "role": "system", "content": "x"}]'),
        "/v1/chat/completions",
    ),
    # Fields of the wrong type or value.
    C("model-null", 400, b'{"model": null, "prompt": "x"}'),
    C("model-empty", 400, doc(model="")),
    C("prompt-object", 400, doc(prompt={"a": 1})),
    C("max-tokens-negative", 400, doc(max_tokens=-1)),
    C("max-tokens-bool", 400, doc(max_tokens=True)),
    C("stream-string", 400, doc(stream="yes")),
    C("messages-not-array", 400, b'{"model": "tiny", "messages": "hi"}', "/v1/chat/completions"),
    C("unknown-model", 404, doc(model="nope")),
    C("priority-not-integer", 400, VALID, **{"x-priority": "high"}),
    # Content types that are not JSON (curl -d sends the form type).
    C("form-content-type", 415, VALID, content_type="application/x-www-form-urlencoded"),
    C("text-content-type", 415, VALID, content_type="text/plain"),
    # Paths that are not an inference API.
    C("unknown-path", 404, VALID, "/v1/secrets"),
    C("root-path", 404, VALID, "/"),
    Case("get-unknown-path", 404, b"GET /admin HTTP/1.1\r\nhost: x\r\n\r\n"),
    Case("dot-dot-path", 404, b"GET /v1/../../etc/passwd HTTP/1.1\r\nhost: x\r\n\r\n"),
    # Envoy's own refusals, before epp sees anything.
    Case(
        "header-64kb",
        431,
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 65536 + b"\r\n\r\n",
    ),
    Case(
        "control-char-in-header",
        400,
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-bad: a\x01b\r\n\r\n",
    ),
    Case(
        "content-length-and-chunked",
        400,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    ),
    Case("garbage-request-line", 400, b"HELLO WORLD\r\n\r\n"),
    # Oversized bodies: a 413 arrives while the client is still sending.
    C("oversized-content-length", 413, doc(prompt="a" * (2 * LIMIT))),
    Case(
        "oversized-chunked",
        413,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n",
        b"".join(b"%x\r\n%s\r\n" % (65536, b"a" * 65536) for _ in range(2 * LIMIT // 65536)),
    ),
    Case(
        "oversized-expect-100-continue",
        413,
        post("/v1/completions", b"a" * (33 * 1024 * 1024), expect="100-continue"),
    ),
]


def check_error_shape(status: int, content_type: str, body: bytes) -> dict[str, object]:
    assert content_type.startswith("application/json"), (status, content_type, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    for key in ("message", "type"):
        assert isinstance(error[key], str), error
        assert error[key], error
    return dict(error)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request_gets_status_and_json(hostile: Stack, case: Case) -> None:
    reply = exchange(hostile.envoy_port, case.head, case.body)
    assert reply.status == case.status, (reply.status, reply.body[:300])
    if case.status == 200:
        return
    check_error_shape(reply.status, reply.headers.get("content-type", ""), reply.body)
    assert "x-served-by" not in reply.headers, "a refused request must never reach a replica"


def test_still_serving_after_the_hostile_cases(hostile: Stack) -> None:
    assert exchange(hostile.envoy_port, post("/v1/completions", VALID), VALID).status == 200
