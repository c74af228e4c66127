"""A request's lifecycle: the context it carries, what its response showed, and the hooks that
learn from it.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from epp.admission.budgets import Charge
from epp.generation import Generation
from epp.request import InferenceRequest
from epp.rewrite import Rewrite
from epp.state.moves import PickRecord
from epp.tracing import RequestTrace

log = logging.getLogger("epp.lifecycle")


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
    # What admission charged to the tenant's budget (None: the tenant has no budget). Its
    # x-ratelimit-* headers go on the response, its tokens are corrected by usage.
    charge: Charge | None = None
    # The pick's footprint (in-flight ticket, prefix insertions, session), moved to the served
    # endpoint after a retry; None until picked.
    pick: PickRecord | None = None
    # The overflow pool the request was spilled to (no replica of ours serves it).
    spilled: str | None = None
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
        return self.context.spilled is not None

    @property
    def charge(self) -> Charge | None:
        return self.context.charge


class ResponseHook(Protocol):
    """Learns from finished responses (runs off the answer path, once per request)."""

    @property
    def name(self) -> str: ...

    def finished(self, done: Finished) -> None: ...


class Lifecycle:
    """The registered response hooks, run in order for each finished response."""

    def __init__(self, hooks: Iterable[ResponseHook] = ()) -> None:
        self._hooks: list[ResponseHook] = list(hooks)

    @property
    def hooks(self) -> tuple[ResponseHook, ...]:
        return tuple(self._hooks)

    def register(self, hook: ResponseHook) -> None:
        """Run ``hook`` for every response that finishes from now on, after those before it."""
        self._hooks.append(hook)

    def finished(self, done: Finished) -> None:
        for hook in self._hooks:
            try:
                hook.finished(done)
            except Exception:
                log.exception(
                    "response hook %s failed for request %s", hook.name, done.request.request_id
                )
