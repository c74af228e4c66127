"""A disaggregated request's prefill leg counts in flight on its prefill replica, from the pick
until the decode replica's first token (the sidecar starts the decode leg only once the prefill
leg answered), and never longer: not after the first token, not after a failed stream, not
twice after a retry moved the request."""

from __future__ import annotations

import json

from epp.extproc.stream import StreamHandler
from epp.state.inflight import InflightTracker, Load
from epp.wire import SERVED
from tests.unit.test_pd_decision import DECODE, HEADER, PREFILL, pd_config, pd_router
from tests.unit.test_response_stream import ROLE, _response_body, _response_headers, token
from tests.unit.test_stream import body_msg, headers_msg

P, D, D2 = PREFILL[0], DECODE[0], DECODE[1]


def test_prefill_leg_counts_on_the_prefill_replica_until_the_first_token() -> None:
    inflight = InflightTracker()
    ticket = inflight.add(D, 1004, prefiller=P, prefiller_tokens=1000)
    assert inflight.load(P) == Load(requests=1, tokens=1000, prefill=1000, waiting=1)
    assert inflight.load(D) == Load(requests=1, tokens=1004, prefill=0, waiting=1)
    ticket = inflight.prefilled(ticket)
    assert inflight.load(P) == Load()
    assert inflight.load(D) == Load(requests=1, tokens=1004, prefill=0, waiting=0)
    inflight.release(ticket)
    assert (inflight.load(P), inflight.load(D)) == (Load(), Load())


def test_a_stream_ending_before_its_first_token_releases_the_prefill_leg() -> None:
    inflight = InflightTracker()
    inflight.release(inflight.add(D, 1004, prefiller=P, prefiller_tokens=1000))
    assert (inflight.load(P), inflight.load(D)) == (Load(), Load())


def test_a_retry_keeps_one_prefill_leg_and_a_late_one_none() -> None:
    inflight = InflightTracker()
    moved = inflight.move(inflight.add(D, 1004, prefiller=P, prefiller_tokens=1000), D2)
    # The retry carries the same prefill header: one leg on P, not two, not none.
    assert inflight.load(P) == Load(requests=1, tokens=1000, prefill=1000, waiting=1)
    assert (inflight.load(D).requests, inflight.load(D2).requests) == (0, 1)
    after = inflight.move(inflight.prefilled(moved), D)
    assert inflight.load(P) == Load()
    inflight.release(after)
    assert inflight.load(D) == inflight.load(D2) == Load()


async def test_routed_prefill_leg_counts_there_until_the_decode_side_streams() -> None:
    router = await pd_router(pd_config(threshold=100))
    inflight = router.fleet.inflight
    handler = StreamHandler(router)
    prompt = "x " * 2000
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
    handler.handle(headers_msg())
    (answer,) = handler.handle(body_msg(json.dumps(body).encode()))
    handler.settle()
    mutation = answer.request_body.response.header_mutation
    set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    prefill, decode = set_headers[HEADER], set_headers["x-gateway-destination-endpoint"]
    decode = decode.split(",")[0]
    # Nothing cached anywhere yet: the prefill replica computes the whole prompt (epp's
    # estimate: 4 characters a token).
    whole = len(prompt) // 4 + 1
    assert inflight.load(prefill) == Load(requests=1, tokens=whole, prefill=whole, waiting=1)
    assert inflight.load(decode).prefill == 0
    handler.handle(
        _response_headers({":status": "200", "content-type": "text/event-stream", SERVED: decode})
    )
    assert inflight.load(prefill).requests == 1  # headers are no token
    handler.handle(_response_body(ROLE + token("a")))
    assert inflight.load(prefill) == Load()
    assert inflight.load(decode).requests == 1
    handler.close()
    assert handler.ticket is not None
    router.finish(handler.ticket)
    assert inflight.load(decode) == Load()
