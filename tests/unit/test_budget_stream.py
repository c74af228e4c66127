"""Tenant budgets on the ext_proc stream: charged at admission, headers on the response,
corrected by the response's usage, refunded when routing refuses the request."""

from __future__ import annotations

import json
import time

import pytest

from epp._proto import core_pb2, ext_proc_pb2
from epp.config import parse_config
from epp.errors import RequestError
from epp.extproc.stream import StreamHandler
from epp.router import Router
from tests.unit.test_stream import BODY, body_msg, headers_msg, immediate, make_router

# The tenant comes from its API key (a trusted source); a raw fairness header would not count.
TENANT = {"authorization": "Bearer sk-evals"}
KEYS = {"sk-evals": {"tenant": "evals"}}


async def budget_router(rpm: int, tpm: int, ready: tuple[str, ...] | None = None) -> Router:
    router = await make_router() if ready is None else await make_router(ready)
    router.config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "budgets": {"tenants": {"evals": {"rpm": rpm, "tpm": tpm}}},
            "request": {"api_keys": KEYS},
        }
    )
    return router


async def admitted(router: Router) -> StreamHandler:
    """A request of the tenant through parse and admission, as the servicer drives it."""
    handler = StreamHandler(router)
    handler.handle(headers_msg(extra=TENANT))
    assert handler.handle(body_msg(BODY)) == ()  # held for admission: budgets are on
    assert handler.pending is not None
    await router.admit(handler.context, handler.pending.request)
    return handler


def response_headers(status: str = "200") -> ext_proc_pb2.ProcessingRequest:
    values = {":status": status, "content-type": "application/json"}
    return ext_proc_pb2.ProcessingRequest(
        response_headers=ext_proc_pb2.HttpHeaders(
            headers=core_pb2.HeaderMap(
                headers=[
                    core_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            )
        )
    )


def added_headers(answer: ext_proc_pb2.ProcessingResponse) -> dict[str, str]:
    mutation = answer.response_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_admitted_responses_carry_the_headers_and_usage_corrects_the_tokens() -> None:
    router = await budget_router(rpm=2, tpm=1000)
    handler = await admitted(router)
    (route,) = handler.resume()
    assert route.WhichOneof("response") == "request_body"
    (answer,) = handler.handle(response_headers())
    headers = added_headers(answer)
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert handler.context.admission.charge is not None
    # Charged at admission: the prompt's estimate and max_tokens.
    assert headers["x-ratelimit-remaining-tokens"] == str(
        1000 - handler.context.admission.charge.tokens
    )
    usage = {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    body = ext_proc_pb2.ProcessingRequest(
        response_body=ext_proc_pb2.HttpBody(body=json.dumps(usage).encode(), end_of_stream=True)
    )
    handler.handle(body)
    handler.settle()  # a complete response's bookkeeping runs after its answer is sent
    assert router.budgets.remaining("evals", "tokens", time.monotonic())[0] == 1000 - 7


async def test_over_the_budget_is_a_429_with_retry_after_and_the_headers() -> None:
    router = await budget_router(rpm=1, tpm=0)
    await admitted(router)
    handler = StreamHandler(router)
    handler.handle(headers_msg(extra=TENANT))
    handler.handle(body_msg(BODY))
    assert handler.pending is not None
    with pytest.raises(RequestError) as refused:
        await router.admit(handler.context, handler.pending.request)
    (answer,) = handler.refuse_pending(refused.value)
    status, payload = immediate(answer)
    assert status == 429
    assert payload["error"]["code"] == "rate_limit_exceeded"
    assert payload["error"]["type"] == "rate_limit_error"
    decoded = {
        h.header.key: h.header.raw_value.decode()
        for h in answer.immediate_response.headers.set_headers
    }
    assert int(decoded["retry-after"]) >= 59
    assert decoded["x-epp-request-dropped-reason"] == "rejected-budget"
    assert decoded["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in decoded


async def test_a_request_routing_refuses_gets_its_budget_back() -> None:
    router = await budget_router(rpm=1, tpm=0, ready=())
    handler = await admitted(router)
    assert router.budgets.remaining("evals", "requests", time.monotonic())[0] == 0
    (answer,) = handler.resume()
    assert immediate(answer)[0] == 503
    assert router.budgets.remaining("evals", "requests", time.monotonic())[0] == 1


async def test_a_reloaded_budget_applies_to_the_next_request() -> None:
    router = await budget_router(rpm=1, tpm=0)
    await admitted(router)
    with pytest.raises(RequestError):
        await admitted(router)
    router.config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "budgets": {"tenants": {"evals": {"rpm": 2}}},
            "request": {"api_keys": KEYS},
        }
    )
    handler = await admitted(router)  # the window kept its one request; the limit is now 2
    assert handler.context.admission.charge is not None
    assert handler.context.admission.charge.headers["x-ratelimit-remaining-requests"] == "0"
