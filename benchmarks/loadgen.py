"""Open-loop Poisson load generator for OpenAI streaming endpoints.

Open loop (each request is sent at its scheduled time whether or not earlier ones finished) is
what exposes a router's queueing: a closed loop slows down with the server and hides it.
Requests stream (SSE) so TTFT is the arrival of the first chunk carrying generated text, not
the chat role chunk an engine may send before any token; output tokens come from the final
usage chunk (``stream_options.include_usage``).

The hot loop never parses JSON: on a 2-core machine shared with the fleet and the router, the
generator's own CPU must stay small or it becomes what is measured. It scans raw bytes for the
first non-empty ``text``/``content`` field and reads ``completion_tokens`` from the stream's tail.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

_FIRST_TOKEN = re.compile(rb'"(?:text|content)":"[^"]')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
_TAIL_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request as sent: path, encoded JSON body and extra headers."""

    path: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    """What happened to one request (times in seconds)."""

    ttft: float | None = None
    output_tokens: int = 0
    error: str = ""
    # Event-loop times the request was sent and ended (answered, failed or timed out).
    started: float = 0.0
    finished: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(slots=True)
class StageRun:
    """Outcomes of one stage, with the timing needed to turn them into rates."""

    outcomes: list[Outcome]
    # From the first send to the last completion: the time the fleet took to do the work.
    busy_s: float
    # Worst lateness of a send against its schedule: large values mean the generator itself
    # was starved of CPU and the offered load was lower than intended.
    max_send_lag_s: float


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Send offsets (seconds from stage start) of a Poisson process of ``rate`` per second."""
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _send(
    session: aiohttp.ClientSession, url: str, request: Request, limit_s: float
) -> Outcome:
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = Outcome(started=start)
    try:
        async with (
            asyncio.timeout(limit_s),
            session.post(url + request.path, data=request.body, headers=request.headers) as resp,
        ):
            if resp.status != 200:
                text = (await resp.read())[:200].decode(errors="replace")
                out.error = f"HTTP {resp.status}: {text.strip()}"
                return out
            head = b""
            tail = b""
            async for chunk in resp.content.iter_any():
                if out.ttft is None:
                    head += chunk
                    if _FIRST_TOKEN.search(head):
                        out.ttft = loop.time() - start
                        head = b""
                tail = (tail + chunk)[-_TAIL_BYTES:]
    except TimeoutError:
        out.error = f"timeout after {limit_s:g}s"
        return out
    except aiohttp.ClientError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        out.finished = loop.time()
    counts = _COMPLETION_TOKENS.findall(tail)
    if not tail.rstrip().endswith(b"data: [DONE]"):
        out.error = "stream ended without [DONE]"
    elif not counts or out.ttft is None:
        out.error = "stream had no tokens or no usage chunk"
    else:
        out.output_tokens = int(counts[-1])
    return out


async def _send_after(
    previous: asyncio.Task[Outcome],
    session: aiohttp.ClientSession,
    url: str,
    request: Request,
    limit_s: float,
    think: float = 0.0,
) -> Outcome:
    """Send ``think`` seconds after ``previous`` (the conversation's last turn) was answered."""
    await asyncio.wait([previous])
    if think > 0:
        await asyncio.sleep(think)
    return await _send(session, url, request, limit_s)


async def run_stage(
    url: str,
    requests: Sequence[Request],
    arrivals: Sequence[float],
    *,
    request_timeout: float,
    drain_timeout: float,
    after: Sequence[int | None] | None = None,
    think: Sequence[float] | None = None,
) -> StageRun:
    """Send ``requests[i]`` at ``arrivals[i]`` seconds, then wait (bounded) for all to finish.

    ``after[i]``, when given and not None, is the index of an earlier request that must have
    been answered first (a chat turn waits for the previous reply): request i is then sent at
    its arrival or ``think[i]`` seconds (default 0) after that one ends, whichever is later,
    and its TTFT counts from then.
    Requests still running ``drain_timeout`` seconds after the last send are cancelled and
    counted as errors, so a saturated router cannot stretch a run without bound.
    """
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        headers={"content-type": "application/json"},
    ) as session:
        start = loop.time()
        tasks: list[asyncio.Task[Outcome]] = []
        lag = 0.0
        for i, (request, at) in enumerate(zip(requests, arrivals, strict=True)):
            delay = start + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag = max(lag, -delay)
            previous = after[i] if after is not None else None
            send = (
                _send(session, url, request, request_timeout)
                if previous is None
                else _send_after(
                    tasks[previous],
                    session,
                    url,
                    request,
                    request_timeout,
                    think[i] if think is not None else 0.0,
                )
            )
            tasks.append(asyncio.create_task(send))
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    outcomes = [
        t.result() if not t.cancelled() else Outcome(error=f"unfinished {drain_timeout:g}s after")
        for t in tasks
    ]
    ends = [o.finished for o in outcomes if o.ok]
    return StageRun(outcomes, (max(ends) - start) if ends else 0.0, lag)
