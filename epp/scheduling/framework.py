"""Plugin interfaces of the scheduler: filters, then weighted scorers, then a picker.

Plugins are small classes registered by name with :func:`register`; a profile (configured in
one YAML file) names plugins and weights. Every plugin is a pure function of the request, the
candidate endpoints and the per-request :class:`Cycle`, so it can be unit-tested, benchmarked
and explained in isolation. Work several plugins need (tokenizing, hashing a prompt) is done
once and kept in the cycle.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from epp.request import InferenceRequest
from epp.state.fleet import FleetState
from epp.state.snapshot import EndpointState, Snapshot

# Keys under which prefix scorers publish cached prompt tokens per endpoint, best source first.
CACHED_TOKEN_KEYS = ("cached_tokens", "approx_cached_tokens")


@dataclass(slots=True)
class Cycle:
    """Per-request scheduling context.

    ``snapshot`` is the endpoint view used for the whole decision, ``fleet`` the long-lived
    routing state (in-flight work, prefix indexes, sessions), ``data`` what one plugin computed
    for others (token ids, block hashes) so per-request work is done once.
    """

    snapshot: Snapshot
    fleet: FleetState = field(default_factory=FleetState)
    # Relative endpoint capacity (configured; missing means 1.0).
    weights: Mapping[str, float] = field(default_factory=dict)
    now: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)

    def cached_tokens(self) -> Mapping[str, int]:
        """Prompt tokens each endpoint caches for this request, as the prefix scorers found
        (precise when available, else approximate; empty when no prefix scorer ran)."""
        for key in CACHED_TOKEN_KEYS:
            found = self.data.get(key)
            if found:
                return found
        return {}


class Plugin:
    """Base of every plugin; ``type_name`` is the registry name, ``name`` the configured one."""

    type_name: ClassVar[str] = ""
    name: str = ""


class Filter(Plugin):
    """Removes candidates that must not serve the request."""

    @abc.abstractmethod
    def filter(
        self, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
    ) -> list[EndpointState]: ...


class Scorer(Plugin):
    """Scores each candidate in [0, 1]; higher is better. Weights are applied by the profile."""

    @abc.abstractmethod
    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> Sequence[float]: ...


class Picker(Plugin):
    """Chooses up to ``count`` endpoints, best first, from candidates and their total scores."""

    @abc.abstractmethod
    def pick(
        self, candidates: Sequence[EndpointState], totals: Sequence[float], count: int
    ) -> list[EndpointState]: ...


class Prepare(Plugin):
    """Work a plugin may have to wait for (tokenizing a long new prompt), done before the
    decision so that scoring itself never waits. Only profiles with such a plugin pay for the
    extra step; a plugin that is already ready returns at once."""

    @abc.abstractmethod
    async def prepare(self, request: InferenceRequest, fleet: FleetState) -> None: ...


class PostPick(Plugin):
    """Told about every pick (after the decision), to update what scoring remembers."""

    @abc.abstractmethod
    def on_pick(self, request: InferenceRequest, endpoint: EndpointState, cycle: Cycle) -> None: ...


P = TypeVar("P", bound=type[Plugin])
_REGISTRY: dict[str, type[Plugin]] = {}


def register(type_name: str, *aliases: str) -> Callable[[P], P]:
    """Class decorator: make a plugin constructible by ``type_name`` (and aliases) from config."""

    def decorate(cls: P) -> P:
        cls.type_name = type_name
        for key in (type_name, *aliases):
            if key in _REGISTRY:
                raise ValueError(f"plugin type '{key}' registered twice")
            _REGISTRY[key] = cls
        return cls

    return decorate


def plugin_types() -> list[str]:
    return sorted(_REGISTRY)


def create_plugin(type_name: str, name: str, parameters: Mapping[str, Any]) -> Plugin:
    """Instantiate a registered plugin; parameters are its constructor's keyword arguments.

    Raises ``KeyError`` for an unknown type and ``ValueError`` for bad parameters, so config
    validation can name the offending key.
    """
    cls = _REGISTRY[type_name]
    try:
        plugin = cls(**parameters)
    except TypeError as exc:
        raise ValueError(f"bad parameters for '{type_name}': {exc}") from None
    plugin.name = name
    return plugin


@dataclass(frozen=True, slots=True)
class Decision:
    """The endpoints chosen, best first (later ones are fallbacks), with scores to explain why."""

    endpoints: list[EndpointState]
    # endpoint -> {scorer name: weighted score, "total": sum}; filled only when asked to explain.
    scores: dict[str, dict[str, float]] | None = None


@dataclass(slots=True)
class Profile:
    """A named pipeline: filters in order, weighted scorers, one picker."""

    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker
    post_pick: list[PostPick] = field(default_factory=list)
    prepare: list[Prepare] = field(default_factory=list)

    def run(
        self,
        request: InferenceRequest,
        candidates: list[EndpointState],
        cycle: Cycle,
        count: int,
        explain: bool = False,
    ) -> Decision:
        for f in self.filters:
            candidates = f.filter(request, candidates, cycle)
            if not candidates:
                return Decision([], {"filtered-out-by": {f.name: 0.0}} if explain else None)
        totals = [0.0] * len(candidates)
        breakdown: dict[str, dict[str, float]] | None = (
            {c.address: {} for c in candidates} if explain else None
        )
        for scorer, weight in self.scorers:
            scores = scorer.score(request, candidates, cycle)
            for i, s in enumerate(scores):
                totals[i] += weight * s
            if breakdown is not None:
                for c, s in zip(candidates, scores, strict=True):
                    breakdown[c.address][scorer.name] = round(weight * s, 4)
        if breakdown is not None:
            for c, t in zip(candidates, totals, strict=True):
                breakdown[c.address]["total"] = round(t, 4)
        chosen = self.picker.pick(candidates, totals, count)
        if chosen:
            for hook in self.post_pick:
                hook.on_pick(request, chosen[0], cycle)
        return Decision(chosen, breakdown)
