"""A minimal blocking HTTP client for tests: status, headers and body, nothing hidden."""

from __future__ import annotations

import http.client
import json
import re
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def served_by(self) -> str | None:
        return self.headers.get("x-served-by")


def request(
    base: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    method: str | None = None,
    timeout: float = 30.0,
) -> Reply:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    all_headers = {"content-type": "application/json", **(headers or {})}
    try:
        conn.request(method or ("GET" if body is None else "POST"), path, payload, all_headers)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def completion(base: str, prompt: str, max_tokens: int = 2, **headers: str) -> Reply:
    return request(
        base,
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens},
        headers,
    )


def metric_values(url: str, name: str) -> dict[str, float]:
    """Samples of one Prometheus metric, keyed by their label text."""
    with urllib.request.urlopen(url, timeout=2) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        values[match.group(1) or ""] = float(match.group(2))
    return values
