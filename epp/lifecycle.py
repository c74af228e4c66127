"""A request's lifecycle: the context it carries, the hooks that admit it, what its response
showed, and the hooks that learn from it.

Admission is a chain of :class:`AdmissionHook` (budgets, spillover, flow control, shedding),
run in order by :class:`Admission` once the request is parsed: a hook lets the request go
on, refuses it (raises a :class:`~epp.errors.RequestError`), sends it to an overflow pool, or
holds it until it may go on; what they decided is the context's :class:`AdmissionVerdict`.
When a later hook or the scheduler refuses the request, every hook withdraws what it took.

The stream state machine (:mod:`epp.extproc.stream`) only translates Envoy's messages: when a
response has ended (or its stream closed first) it builds one :class:`Finished` and hands it
to every registered :class:`ResponseHook`, in registration order, after the last answer went
out. Metrics, the budget correction, the autoscaling demand, the latency model and passive
health are such hooks, each in the package of the feature it serves; a new response-side job
is a new hook registered with :class:`Lifecycle`, not an edit of the stream handler. A hook
that raises costs what it would have recorded, never the request or the hooks after it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, runtime_checkable

from epp.admission.budgets import Charge
from epp.generation import Generation
from epp.request import InferenceRequest
from epp.rewrite import Rewrite
from epp.state import EndpointState
from epp.state.moves import PickRecord
from epp.tracing import RequestTrace

log = logging.getLogger("epp.lifecycle")
H = TypeVar("H")
# The candidates a request may go to.
Endpoints = list[EndpointState]


@dataclass(frozen=True, slots=True)
class Usage:
    """A response's token usage; ``cached`` is None when the engine did not report it."""

    prompt: int
    completion: int
    cached: int | None = None


@dataclass(slots=True)
class Outcome:
    """The facts of one finished (or abandoned) response."""

    served: str | None
    status: int
    seconds: float
    complete: bool
    streamed: bool
    usage: Usage | None = None
    ttft: float | None = None
    tpot: float | None = None
    # Gaps between consecutive token events, in order.
    itl: list[float] = field(default_factory=list)


@dataclass(slots=True)
class AdmissionVerdict:
    """What the admission hooks decided about one request."""

    # Every hook let it go on (or one sent it elsewhere): it may be routed.
    admitted: bool = False
    # What the budget hook charged to the tenant (None: the tenant has no budget). Its
    # x-ratelimit-* headers go on the response, its tokens are corrected by usage.
    charge: Charge | None = None
    # The overflow pool the spill hook sent the request to (no replica of ours serves it).
    spill: str | None = None
    # A hook held the request (flow control) before it was admitted.
    held: bool = False


@dataclass(slots=True)
class RequestContext:
    """Everything one request carries from its stream's first message to its last.

    The stream state machine fills it in as the request goes: the configuration captured when
    the stream opened (kept to its end whatever reloads), the headers, the parsed request,
    what admission charged, the pick and where the request went; the response hooks read it
    in :class:`Finished`."""

    generation: Generation
    # The stream's clock when the request headers arrived (latency timings count from it).
    started: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    # The gateway's allowed endpoints (``envoy.lb.subset_hint``), None when absent.
    subset: list[str] | None = None
    # Once the body is parsed.
    request: InferenceRequest | None = None
    # What admission decided: budget charge, spill, hold.
    admission: AdmissionVerdict = field(default_factory=AdmissionVerdict)
    # The pick's footprint (in-flight ticket, prefix insertions, session), moved to the served
    # endpoint after a retry; None until picked.
    pick: PickRecord | None = None
    # Only for a sampled request while tracing is configured (epp.tracing).
    trace: RequestTrace | None = None
    # The streamed response will end with usage (the client's or epp's include_usage, or the
    # Responses API's response.completed): the TTFT may wait for it.
    usage_expected: bool = False
    # epp added stream_options.include_usage: the usage chunk is hidden from the client.
    strip_usage: bool = False
    # The model rewrite that applied (epp.rewrite): the request's model is its target.
    rewrite: Rewrite | None = None

    def requested_label(self) -> str:
        """The ``model_name`` label: the model the client asked for (a bounded value: a
        configured model or a rule's name), the request's model when nothing rewrote it."""
        if self.rewrite is not None:
            return self.rewrite.requested
        return self.request.model if self.request is not None else ""


@dataclass(frozen=True, slots=True)
class Finished:
    """One request's response as the hooks see it, once its stream is done."""

    context: RequestContext
    # The context's parsed request (a response follows only a parsed request).
    request: InferenceRequest
    outcome: Outcome
    # The request's objective when it is a configured one ('' otherwise): a bounded label.
    objective: str

    @property
    def pick(self) -> PickRecord | None:
        return self.context.pick

    @property
    def spilled(self) -> bool:
        """Sent to an overflow pool: none of our replicas served it, none learns from it."""
        return self.context.admission.spill is not None

    @property
    def charge(self) -> Charge | None:
        return self.context.admission.charge


class ResponseHook(Protocol):
    """Learns from finished responses (runs off the answer path, once per request)."""

    @property
    def name(self) -> str: ...

    def finished(self, done: Finished) -> None: ...


class _Registry(Generic[H]):
    """Hooks of one kind, run in the order they were registered."""

    def __init__(self, hooks: Iterable[H] = ()) -> None:
        self._hooks: list[H] = list(hooks)

    @property
    def hooks(self) -> tuple[H, ...]:
        return tuple(self._hooks)

    def register(self, hook: H) -> None:
        """Run ``hook`` for every request from now on, after those registered before it."""
        self._hooks.append(hook)


class Lifecycle(_Registry[ResponseHook]):
    """The registered response hooks, run in order for each finished response."""

    def finished(self, done: Finished) -> None:
        for hook in self._hooks:
            try:
                hook.finished(done)
            except Exception:
                log.exception(
                    "response hook %s failed for request %s", hook.name, done.request.request_id
                )


# What a hook returns to hold a request: awaited before the next hook runs.
Hold = Callable[[], Awaitable[None]]


class AdmissionHook(Protocol):
    """One step of admission (runs on the request path, once per request)."""

    @property
    def name(self) -> str: ...

    def admit(self, context: RequestContext, request: InferenceRequest) -> Hold | None:
        """Let the request go on (None), refuse it (raise a RequestError), set the verdict's
        ``spill`` (the hooks after this one are skipped) or return the hold to await."""
        ...

    def withdraw(self, context: RequestContext) -> None:
        """The request will not run (refused later, or its client left): give back what
        :meth:`admit` took."""
        ...


@runtime_checkable
class Narrowing(Protocol):
    """An admission hook that also says which candidates an admitted request may go to."""

    def narrow(
        self, gen: Generation, request: InferenceRequest, found: Endpoints, now: float
    ) -> Endpoints:
        """Those of the ``found`` candidates the request may go to (at time ``now``)."""
        ...


class Admission(_Registry[AdmissionHook]):
    """The registered admission hooks, run in order for each parsed request."""

    def __init__(self, hooks: Iterable[AdmissionHook] = ()) -> None:
        # Which hooks narrow is decided once, at registration: an isinstance check against a
        # Protocol walks the protocol's attributes, far too dear for every request.
        self._narrowing: list[Narrowing] = []
        super().__init__()
        for hook in hooks:
            self.register(hook)

    def register(self, hook: AdmissionHook) -> None:
        super().register(hook)
        if isinstance(hook, Narrowing):
            self._narrowing.append(hook)

    async def admit(self, context: RequestContext, request: InferenceRequest) -> None:
        """Run every hook, awaiting each hold; raise the RequestError of the hook that refuses
        (cancelled, as when the client leaves, the request is withdrawn too)."""
        verdict = context.admission
        try:
            for hook in self._hooks:
                hold = hook.admit(context, request)
                if hold is not None:
                    verdict.held = True
                    await hold()
                if verdict.spill is not None:
                    break
        except BaseException:
            self.withdraw(context)
            raise
        verdict.admitted = True

    def admit_now(self, context: RequestContext, request: InferenceRequest) -> None:
        """:meth:`admit` for a stream that does not await (its generation holds nothing): a
        hook that would suspend it is a configuration the stream should have awaited."""
        run = self.admit(context, request)
        try:
            run.send(None)
        except StopIteration:
            return
        run.close()  # withdraws what the hooks took
        raise RuntimeError(f"admission of {request.request_id} had to wait but was not awaited")

    def withdraw(self, context: RequestContext) -> None:
        """The request will not run: every hook gives back what it took, last first."""
        for hook in reversed(self._hooks):
            try:
                hook.withdraw(context)
            except Exception:
                log.exception("admission hook %s failed to withdraw", hook.name)

    def narrow(
        self, gen: Generation, request: InferenceRequest, found: Endpoints, now: float
    ) -> Endpoints:
        """The candidates the hooks let an admitted request (of a stream that captured
        ``gen``) go to."""
        for hook in self._narrowing:
            found = hook.narrow(gen, request, found, now)
        return found
