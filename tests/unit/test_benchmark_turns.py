"""The mixed workload's chat turns wait for the previous reply, over real HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks.loadgen import Request, run_stage
from benchmarks.routing import Stage
from benchmarks.workloads import Mixed

SSE = (
    b'data: {"choices":[{"text":"hi"}]}\n\n'
    b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


def test_mixed_chat_turns_follow_their_conversation() -> None:
    items = list(itertools.islice(Mixed(seed=3).stream(), 200))
    chats = [i for i in items if i.follows is not None]
    groups = [i for i in items if i.follows is None]
    assert chats
    assert groups
    assert all(i.key == i.follows for i in chats)
    stage = Stage(1.0, items, [0.0] * len(items), 0.0)
    after = stage.after()
    assert after is not None
    for i, previous in enumerate(after):
        if previous is not None:
            assert previous < i
            assert items[previous].follows == items[i].follows
    # The first turn of each conversation in the stage waits for nothing.
    firsts = {i.follows: n for n, i in reversed(list(enumerate(items))) if i.follows}
    assert all(after[n] is None for n in firsts.values())


async def test_a_turn_is_sent_only_after_the_previous_reply() -> None:
    log: list[tuple[str, str]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        name = json.loads(await request.read())["name"]
        log.append(("start", name))
        await asyncio.sleep(0.2 if name == "first" else 0.0)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE)
        log.append(("end", name))
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app)
    await server.start_server()
    try:
        requests = [
            Request("/v1/completions", json.dumps({"name": n}).encode())
            for n in ("first", "second")
        ]
        run = await run_stage(
            str(server.make_url("")).rstrip("/"),
            requests,
            [0.0, 0.01],
            request_timeout=5,
            drain_timeout=5,
            after=[None, 0],
        )
    finally:
        await server.close()
    assert all(o.ok for o in run.outcomes), [o.error for o in run.outcomes]
    assert log.index(("start", "second")) > log.index(("end", "first"))
