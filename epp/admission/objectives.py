"""Admission driven by objectives: room measured in predicted latency, not in request counts.

In ``queue`` mode with objectives at more than one priority, lower-priority work is released
only while the next arrival of every higher-priority objective would still meet its TTFT
target on some replica (docs/admission.md, "Objectives instead of limits"):

- the target is the objective's ``ttft_ms``, or, without one, :data:`DEFAULT_FACTOR` times
  the TTFT the latency model predicts for it on an idle replica;
- the prediction is the latency model's (:mod:`epp.state.latency`, learned from every
  response), for a prompt of the objective's typical size (its arrivals' mean), counting the
  prefill epp already has queued on that replica and the request about to be released;
- the replicas that would meet the target must keep free decode slots after the release for
  that priority's arrivals expected within its target (its arrival rate times the target,
  at least one): a replica's KV cache holds ``capacity / tokens per running request``
  requests (both read from its metrics, the tokens per request learned as it runs), and
  what epp has in flight there takes slots first.

Nothing here is a count a user sets: speeds, sizes and slots are learned and re-learned as
they change. The explicit limits (``max_requests``, ``max_tokens``, the reserves) still apply
on top when they are set. Nothing here does I/O or reads a clock: callers pass ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from epp.state.inflight import Load
from epp.state.latency import ttft_features
from epp.state.snapshot import EndpointState

# An objective without ``ttft_ms`` is protected at this multiple of its idle-replica TTFT.
DEFAULT_FACTOR = 1.5
# Weight of the newest sample in the running means (arrival sizes, KV tokens per request).
SMOOTHING = 0.05
# Prompt tokens assumed for a priority before any of its requests arrived.
DEFAULT_PROMPT = 256.0
# Time constant of each priority's measured arrival rate, seconds.
RATE_SECONDS = 10.0

Predict = Callable[[str, Sequence[float], float], float]


@dataclass(frozen=True, slots=True)
class Protected:
    """A priority that lower priorities must leave room for; ``ttft`` in seconds (None: the
    default target)."""

    priority: int
    ttft: float | None


@dataclass(frozen=True, slots=True)
class Objectives:
    """The priorities admission protects, highest first (empty: count-based admission only),
    and every configured priority."""

    protected: tuple[Protected, ...] = ()
    priorities: frozenset[int] = frozenset()

    @classmethod
    def build(cls, priorities: Mapping[str, int], ttft: Mapping[str, float | None]) -> Objectives:
        """Every configured priority above the lowest, each with the tightest TTFT target of
        its objectives (None when none sets one)."""
        if len(set(priorities.values())) < 2:
            return cls()
        lowest = min(priorities.values())
        levels: dict[int, list[float]] = {}
        for name, priority in priorities.items():
            if priority > lowest:
                targets = levels.setdefault(priority, [])
                target = ttft.get(name)
                if target is not None:
                    targets.append(target)
        protected = (
            Protected(p, min(levels[p], default=None)) for p in sorted(levels, reverse=True)
        )
        return cls(tuple(protected), frozenset(priorities.values()))

    def above(self, priority: int) -> tuple[Protected, ...]:
        return tuple(p for p in self.protected if p.priority > priority)


class Headroom:
    """Learned sizes and the release rule; lives as long as the router (survives reloads)."""

    def __init__(self, predict: Predict) -> None:
        self._predict = predict
        # Mean prompt tokens of each configured priority's arrivals.
        self._prompt: dict[int, float] = {}
        # Each configured priority's arrival rate (per second) and when it was last updated.
        self._rate: dict[int, tuple[float, float]] = {}
        # Mean KV tokens one running request holds, per endpoint (from its metrics).
        self._per_request: dict[str, float] = {}

    def arrived(
        self, priority: int, prompt_tokens: int, configured: frozenset[int], now: float
    ) -> None:
        """A request of ``priority`` arrived; only ``configured`` priorities are kept, so the
        tables stay bounded whatever clients send and however often it is reloaded."""
        if priority not in configured:
            return
        if not self._prompt.keys() <= configured:
            self._prompt = {p: s for p, s in self._prompt.items() if p in configured}
            self._rate = {p: r for p, r in self._rate.items() if p in configured}
        self._rate[priority] = (self.rate(priority, now) + 1 / RATE_SECONDS, now)
        known = self._prompt.get(priority)
        self._prompt[priority] = (
            float(prompt_tokens) if known is None else known + SMOOTHING * (prompt_tokens - known)
        )

    def rate(self, priority: int, now: float) -> float:
        """Requests of ``priority`` arriving per second, lately (exponentially weighted)."""
        rate, at = self._rate.get(priority, (0.0, now))
        return rate * math.exp(-max(0.0, now - at) / RATE_SECONDS)

    def forget(self, endpoints: Iterable[str]) -> None:
        """Keep what was learned about ``endpoints`` only (the others left)."""
        kept = set(endpoints)
        self._per_request = {a: v for a, v in self._per_request.items() if a in kept}

    def allows(
        self,
        priority: int,
        objectives: Objectives,
        candidates: Sequence[EndpointState],
        load: Callable[[str], Load],
        now: float,
    ) -> bool:
        """May a request of ``priority`` go now? Yes when, for every protected priority above
        it, the candidates that would still start that priority's next arrival within its
        target, with this request there too, keep free decode slots for the arrivals expected
        within the target (at least one) besides the one this request takes."""
        released = self._prompt.get(priority, DEFAULT_PROMPT)
        for protected in objectives.above(priority):
            size = self._prompt.get(protected.priority, DEFAULT_PROMPT)
            target = protected.ttft
            if target is None:
                target = DEFAULT_FACTOR * self._idle_ttft(size, candidates, now)
            expected = max(1, math.ceil(self.rate(protected.priority, now) * target))
            free = 0.0
            for c in candidates:
                current = load(c.address)
                if self._starts(c, current, released, size, target, now):
                    free += max(0.0, self.free_slots(c, current))
            if free < 1 + expected:
                return False
        return True

    def free_slots(self, endpoint: EndpointState, load: Load) -> float:
        """Requests ``endpoint``'s KV cache could still start (infinite when its cache
        geometry or the size of its requests is not known yet); learns the KV tokens a
        running request holds there from the metrics it reads."""
        metrics = endpoint.metrics
        blocks = metrics.usable_kv_blocks
        if blocks is None or metrics.block_size is None:
            return float("inf")
        capacity = blocks * metrics.block_size
        if metrics.running and metrics.kv_usage > 0:
            sample = metrics.kv_usage * capacity / metrics.running
            known = self._per_request.get(endpoint.address)
            self._per_request[endpoint.address] = (
                sample if known is None else known + SMOOTHING * (sample - known)
            )
        per_request = self._per_request.get(endpoint.address)
        if per_request is None:
            return float("inf")
        busy = max(load.requests, metrics.running + metrics.waiting)
        return capacity / per_request - busy

    def _starts(
        self,
        endpoint: EndpointState,
        load: Load,
        released: float,
        size: float,
        target: float,
        now: float,
    ) -> bool:
        """With the released request there, would ``endpoint`` still start an arrival of
        ``size`` prompt tokens within ``target``?"""
        after = Load(
            load.requests + 1, load.tokens, load.prefill + round(released), load.waiting + 1
        )
        features = ttft_features(size, after, endpoint)
        return self._predict(endpoint.address, features, now) <= target

    def _idle_ttft(self, size: float, candidates: Sequence[EndpointState], now: float) -> float:
        """The best TTFT predicted for ``size`` prompt tokens on an idle candidate."""
        idle = ttft_features(size, Load(), EndpointState("", ""))
        return min((self._predict(c.address, idle, now) for c in candidates), default=0.0)
