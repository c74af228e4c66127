"""Admission is a chain of registered request hooks (epp.lifecycle.Admission), tested against
fakes without gRPC: hooks run in order, a hold is awaited before the next hook is asked, a
refusal (or a client leaving while held) makes every hook give back what it took, a spill
skips the hooks after it, and the stream state machine answers what the chain decided."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from epp import errors
from epp.extproc.stream import StreamHandler
from epp.generation import Generation
from epp.hooks.request.flow import FlowHold
from epp.lifecycle import Admission, Endpoints, Hold, RequestContext
from epp.request import InferenceRequest
from epp.state import EndpointState
from tests.unit.test_stream import BODY, body_msg, headers_msg, immediate, make_router


@dataclass
class Fake:
    """Records what it is asked; refuses, spills or holds on demand."""

    name: str
    log: list[str]
    refuse: bool = False
    spill: str | None = None
    hold: asyncio.Event | None = None
    taken: int = 0

    def admit(self, context: RequestContext, request: InferenceRequest) -> Hold | None:
        self.log.append(f"admit {self.name}")
        if self.refuse:
            raise errors.overloaded(request.model)
        self.taken += 1
        context.admission.spill = self.spill
        event = self.hold
        if event is None:
            return None
        return event.wait

    def withdraw(self, context: RequestContext) -> None:
        self.log.append(f"withdraw {self.name}")
        self.taken = 0


@dataclass
class Keep:
    """Narrows the candidates to the ones it names."""

    keep: set[str]
    name: str = "keep"
    log: list[str] = field(default_factory=list)

    def admit(self, context: RequestContext, request: InferenceRequest) -> Hold | None:
        return None

    def withdraw(self, context: RequestContext) -> None:
        pass

    def narrow(
        self, gen: Generation, request: InferenceRequest, found: Endpoints, now: float
    ) -> Endpoints:
        return [c for c in found if c.address in self.keep]


def _request() -> InferenceRequest:
    return InferenceRequest("r", "/v1/completions", "completions", "tiny", "hi")


async def _context() -> RequestContext:
    return RequestContext((await make_router()).generation)


async def test_hooks_run_in_order_and_a_hold_is_awaited_before_the_next() -> None:
    log: list[str] = []
    gate = asyncio.Event()
    chain = Admission([Fake("budget", log), Fake("queue", log, hold=gate)])
    chain.register(Fake("shed", log))
    context = await _context()
    admitted = asyncio.create_task(chain.admit(context, _request()))
    for _ in range(10):
        await asyncio.sleep(0)
    assert log == ["admit budget", "admit queue"]  # held: the last hook is not asked yet
    assert not admitted.done()
    gate.set()
    await asyncio.wait_for(admitted, 5)
    assert log == ["admit budget", "admit queue", "admit shed"]
    assert context.admission.admitted
    assert context.admission.held


async def test_a_refusal_withdraws_every_hook_last_first() -> None:
    log: list[str] = []
    first, second = Fake("budget", log), Fake("queue", log)
    chain = Admission([first, second, Fake("shed", log, refuse=True)])
    context = await _context()
    with pytest.raises(errors.RequestError) as refused:
        await chain.admit(context, _request())
    assert refused.value.status == 429
    assert log[3:] == ["withdraw shed", "withdraw queue", "withdraw budget"]
    assert first.taken == second.taken == 0
    assert not context.admission.admitted


async def test_a_client_leaving_while_held_withdraws_what_was_taken() -> None:
    log: list[str] = []
    budget = Fake("budget", log)
    chain = Admission([budget, Fake("queue", log, hold=asyncio.Event())])
    admitted = asyncio.create_task(chain.admit(await _context(), _request()))
    for _ in range(10):
        await asyncio.sleep(0)
    assert budget.taken == 1
    admitted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admitted
    assert budget.taken == 0
    assert "withdraw budget" in log


async def test_a_spill_skips_the_hooks_after_it() -> None:
    log: list[str] = []
    chain = Admission([Fake("spill", log, spill="east"), Fake("queue", log)])
    context = await _context()
    await chain.admit(context, _request())
    assert log == ["admit spill"]
    assert context.admission.spill == "east"
    assert context.admission.admitted


async def test_admitting_without_awaiting_refuses_a_hold_that_waits() -> None:
    log: list[str] = []
    budget = Fake("budget", log)
    chain = Admission([budget, Fake("queue", log, hold=asyncio.Event())])
    context = await _context()
    with pytest.raises(RuntimeError):
        chain.admit_now(context, _request())
    assert budget.taken == 0
    assert not context.admission.admitted
    # Without a hold that waits, the same chain admits at once.
    ready = asyncio.Event()
    ready.set()
    quick = Admission([Fake("budget", log), Fake("queue", log, hold=ready)])
    quick.admit_now(context, _request())
    assert context.admission.admitted


async def test_only_narrowing_hooks_choose_candidates() -> None:
    context = await _context()
    chain = Admission([Fake("budget", []), Keep({"b"})])
    candidates = [EndpointState("a", "main"), EndpointState("b", "main")]
    kept = chain.narrow(context.generation, _request(), candidates, 0.0)
    assert [c.address for c in kept] == ["b"]


async def test_the_stream_answers_the_chain_s_refusal_and_withdraws() -> None:
    router = await make_router()
    log: list[str] = []
    router.admission = Admission([Fake("budget", log), Fake("shed", log, refuse=True)])
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    (answer,) = handler.handle(body_msg(BODY))  # nothing to await: admitted in the stream
    status, payload = immediate(answer)
    assert status == 429
    assert payload["error"]["code"] == "overloaded"  # type: ignore[index]
    assert "withdraw budget" in log
    assert handler.ticket is None


async def test_a_scheduler_refusal_withdraws_the_admission() -> None:
    router = await make_router(ready=())
    log: list[str] = []
    budget = Fake("budget", log)
    router.admission = Admission([budget])
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    (answer,) = handler.handle(body_msg(BODY))
    assert immediate(answer)[0] == 503  # no ready replica
    assert budget.taken == 0
    assert log == ["admit budget", "withdraw budget"]


async def test_the_flow_hook_keeps_a_released_request_off_full_replicas() -> None:
    router = await make_router()
    hook = next(h for h in router.admission.hooks if isinstance(h, FlowHold))
    candidates = [EndpointState("a", "main"), EndpointState("b", "main")]
    # Not in queue mode: flow control neither holds nor narrows.
    context = RequestContext(router.generation)
    assert hook.admit(context, _request()) is None
    assert hook.narrow(router.generation, _request(), candidates, 0.0) == candidates
