"""Where should epp read responses? The measurements behind docs/response-path.md.

Envoy layouts over the same local stack (real Envoy, one epp, one replica streaming a token
every 10 ms, stamped with its send time):

- ``routing``: what ``epp envoy-config`` renders: epp's routing stream also processes the
  response; ``failure_mode_allow`` true in buffered mode, false in full-duplex mode.
- ``routing-closed``: the same with ``failure_mode_allow: false`` in both modes.
- ``none-closed``: no response processing, fail closed (epp before issue 16); the routing
  stream still stays open until the response ends (``response_trailer_mode: SEND``).
- ``observer``: the routing stream (fail closed) ends after routing; a second ext_proc filter in
  ``observability_mode`` sends the response to epp without waiting for answers.

For each: (1) over sequential streams with epp alive, each token's delivery lag (replica
write to client read) and the gaps between token arrivals, p50 and p99; (2) SIGKILL of epp
while a streamed response is under way: does the client still get the rest (``[DONE]``)?
Run: ``.venv/bin/python -m benchmarks.response_path [--mode buffered] [--streams 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from epp.devstack import Stack, free_port
from epp.envoy_config import ext_proc_settings

VARIANTS = ("routing", "routing-closed", "none-closed", "observer")


class VariantStack(Stack):
    """A Stack whose rendered Envoy bootstrap is rewritten into one of :data:`VARIANTS`."""

    variant: str = "routing"

    def write_configs(self) -> None:
        super().write_configs()
        if self.variant == "routing":
            return
        boot = yaml.safe_load(self.envoy_path.read_text())
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        filters = hcm["typed_config"]["http_filters"]
        (ext,) = ext_proc_settings(boot)
        ext["failure_mode_allow"] = False
        mode = ext["processing_mode"]
        if self.variant == "routing-closed":
            self.envoy_path.write_text(yaml.safe_dump(boot, sort_keys=False))
            return
        mode["response_header_mode"] = "SKIP"
        mode["response_body_mode"] = "NONE"
        if self.variant == "observer":
            mode["response_trailer_mode"] = "SKIP"
            observer = json.loads(json.dumps(filters[1]))
            observer["name"] = "epp.observe"
            cfg = observer["typed_config"]["extension_config"]["typed_config"]
            cfg["observability_mode"] = True
            cfg["failure_mode_allow"] = True
            cfg["processing_mode"] = {
                "request_header_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "STREAMED",
                "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            }
            cfg.pop("allow_content_length_header", None)
            filters.insert(1, observer)
        self.envoy_path.write_text(yaml.safe_dump(boot, sort_keys=False))


class StampingReplica:
    """A vLLM-like replica in this process: streams ``tokens`` chat chunks ``interval`` apart,
    each stamped with its send time on the client's clock (``perf_counter``, same process), so
    the client sees how long each token took to cross Envoy (and epp) to it."""

    def __init__(self, tokens: int, interval: float) -> None:
        self.tokens = tokens
        self.interval = interval
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> StampingReplica:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _serve(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                text="vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"
            )

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.tokens):
                chunk = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}], "t": 0.0}
                chunk["t"] = time.perf_counter()
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(self.interval)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # Envoy reset the stream (the kill measurement): nothing left to send
        return resp


def _stream(url: str, on_fifth: Any = None) -> tuple[bool, list[float], list[float]]:
    """One streamed chat completion: (ended with [DONE], per-token delivery lag, gaps between
    token arrivals)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "stamp", "messages": [{"role": "user", "content": "go"}], "stream": True}
    buffer = b""
    done = False
    lags: list[float] = []
    arrivals: list[float] = []
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), {})
        resp = conn.getresponse()
        while True:
            try:
                chunk = resp.read1(65536)
            except (http.client.HTTPException, OSError):
                break
            if not chunk:
                break
            now = time.perf_counter()
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event == b"data: [DONE]":
                    done = True
                elif event.startswith(b"data: {"):
                    lags.append(now - json.loads(event[6:])["t"])
                    arrivals.append(now)
            if on_fifth is not None and len(arrivals) >= 5:
                on_fifth()
                on_fifth = None
    except (http.client.HTTPException, OSError):
        pass
    finally:
        conn.close()
    return done, lags, [b - a for a, b in itertools.pairwise(arrivals)]


def _ms(values: list[float], q: int) -> float:
    return round(statistics.quantiles(values, n=100)[q - 1] * 1000, 3)


def measure(variant: str, mode: str, streams: int, tokens: int, interval: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, StampingReplica(tokens, interval) as replica:
        stack = VariantStack(
            Path(tmp),
            mode=mode,  # type: ignore[arg-type]
            replicas=1,  # the simulator serves model tiny, which only the stack's checks use
            config_extra={
                "models": {"stamp": {"pools": ["stamp"]}},
                "pools": {"stamp": {"endpoints": [replica.address]}},
            },
        )
        stack.variant = variant
        with stack:
            stack.start()
            metrics = f"http://127.0.0.1:{stack.epp_ports[0][2]}/debug/endpoints"
            deadline = time.monotonic() + 10
            while (
                not json.loads(urllib.request.urlopen(metrics, timeout=2).read())
                .get(replica.address, {})
                .get("ready")
            ):
                assert time.monotonic() < deadline, "the replica never became ready in epp"
                time.sleep(0.05)
            lags: list[float] = []
            gaps: list[float] = []
            for _ in range(streams):
                ok, lag, gap = _stream(stack.url)
                assert ok, f"{variant}: a stream failed with epp alive"
                lags += lag
                gaps += gap
            survived, _, _ = _stream(stack.url, on_fifth=stack.procs["epp0"].kill)
    return {
        "variant": variant,
        "mode": mode,
        "lag_p50_ms": _ms(lags, 50),
        "lag_p99_ms": _ms(lags, 99),
        "itl_p50_ms": _ms(gaps, 50),
        "itl_p99_ms": _ms(gaps, 99),
        "tokens": len(lags),
        "stream_survives_epp_kill": survived,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mode", action="append", choices=["buffered", "full-duplex"])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="between tokens")
    args = parser.parse_args()
    for mode in args.mode or ["buffered", "full-duplex"]:
        for variant in VARIANTS:
            print(
                json.dumps(
                    measure(variant, mode, args.streams, args.tokens, args.interval_ms / 1000)
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
