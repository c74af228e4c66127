"""From a parsed request to a routing decision: model lookup, candidates, profile, fallbacks.

The router reads only a :class:`~epp.generation.Generation` (a configuration and its profile)
and the store's local snapshot, so a decision costs no I/O. Each configuration swap builds a new
generation; a stream keeps the one it captured when it opened, so a request is admitted and
routed under one configuration. What plugins learn lives in the fleet state, so the new
instances carry on where the old ones stopped. Which endpoints serve a model is always the
current answer (discovery changes it under running streams).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from epp import errors
from epp.admission.budgets import Budgets
from epp.admission.controller import FlowController
from epp.admission.flow_queue import QueueLimits
from epp.admission.room import Room
from epp.admission.spillover import inflight_key
from epp.config import Config
from epp.discovery.policy import ClusterPolicy
from epp.discovery.settling import Settling
from epp.generation import Generation
from epp.hooks import standard_lifecycle
from epp.hooks.request import standard_admission
from epp.lifecycle import RequestContext
from epp.metrics.demand import PoolDemand
from epp.metrics.plugin_clock import Lap
from epp.observability import (
    DECISION_SECONDS,
    DISAGG_DECISIONS,
    LATENCY_TARGETS,
    PICKS,
    REQUESTS,
    SPILLED,
)
from epp.request import InferenceRequest, LatencyTarget
from epp.rewrite import Rewrite
from epp.scheduling import Cycle, Decision
from epp.scheduling.data import LATENCY_TARGET
from epp.scheduling.prefix_data import CACHED_TOKENS
from epp.state import EndpointState
from epp.state.fleet import FleetState
from epp.state.inflight import Ticket
from epp.state.latency import Basis, ttft_features
from epp.tracing import Tracing

log = logging.getLogger("epp.router")

# Explained decisions kept for GET /debug/decisions (only while explaining is on).
RECENT_DECISIONS = 1000


class Router:
    """Picks endpoints for requests under one (replaceable) configuration."""

    def __init__(self, config: Config, fleet: FleetState) -> None:
        self.fleet = fleet
        # Autoscaling signals (docs/autoscaling.md); survives reloads, like the fleet state.
        self.demand = PoolDemand(config.autoscaling)
        # Discovered endpoints Envoy may not have resolved yet (set before the config below).
        self.settling = Settling()
        # Saturation and room of each model's candidates, under the current configuration.
        self.room = Room(fleet, lambda: self._gen.config.admission, lambda: self._gen.objectives)
        # Holds requests while their pool is saturated (admission mode ``queue``).
        self.flow = FlowController(QueueLimits(), self.room.saturated, group=fleet.queues)
        # Tenant budgets: what each tenant spent and holds leased (docs/admission.md).
        self.budgets = Budgets(config.budgets)
        # What decides whether a parsed request may be routed: budgets, spillover, flow
        # control, shedding (epp/hooks/request/).
        self.admission = standard_admission(fleet, self.budgets, self.flow, self.room, self.arrived)
        # What the cluster's resources add (docs/rewrite.md); set by the server as they change.
        self._cluster = ClusterPolicy()
        self._reported: frozenset[str] = frozenset()
        self.config = config
        # What finished responses teach: metrics, budgets, demand, latency, passive health.
        self.lifecycle, self.learning = standard_lifecycle(
            fleet, self.budgets, self.demand, lambda: self._pools, lambda: self._gen.config.pools
        )
        self.decisions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # Set by the server when the configuration turns tracing on (epp.tracing).
        self.tracing: Tracing | None = None
        # Where ties between idle replicas start for pass-through paths (pass_through).
        self._rotation = 0
        # The last capacities handed to scorers: (learned, configured, merged).
        self._weights: tuple[Mapping[str, float], Mapping[str, float], Mapping[str, float]] = (
            {},
            {},
            {},
        )

    @property
    def config(self) -> Config:
        """The current configuration as the file gives it (a stream reads the one its
        :class:`Generation` holds, the cluster's objectives merged in)."""
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        # Everything derived from the config is rebuilt together and swapped at once; streams
        # already open keep the generation they captured.
        self._config = config
        self._build()
        self._candidates = {m: config.endpoints_for_model(m) or () for m in config.models}
        self._pools = config.endpoint_pools()
        self._models_body = _models_body(config)
        # Each model's pools and the share of an arrival each gets, settled per configuration
        # (routed requests count their demand on every pick).
        self._arrival_shares = {m: _shares(a, self._pools) for m, a in self._candidates.items()}
        self.room.configure(self._candidates, self._pools)
        self.settling.update(config.pools, config.discovery)
        self.demand.policy = config.autoscaling
        self.demand.forget(set(config.pools))
        self.flow.limits = config.flow_control.limits
        self.flow.use_group = config.flow_control.scope == "group"
        self.budgets.policy = config.budgets
        self.flow.bound.configure(
            [*config.budgets.tenants, *(k.tenant for k in config.request.api_keys.values())],
            [*config.request.objectives.values(), *config.flow_control.limits.bands],
        )

    @property
    def cluster(self) -> ClusterPolicy:
        return self._cluster

    @cluster.setter
    def cluster(self, cluster: ClusterPolicy) -> None:
        """The cluster's rewrites and objectives changed: streams opening from now on use them."""
        self._cluster = cluster
        self._build()

    def _build(self) -> None:
        self._gen = Generation.build(self._config, self._cluster)
        for profile in (self._gen.profile, self._gen.prefill):
            if profile is not None:
                profile.declare(self.fleet)
        problems = frozenset(self._gen.problems)
        for problem in sorted(problems - self._reported):  # each logged once while it lasts
            log.warning("%s", problem)
        self._reported = problems

    @property
    def generation(self) -> Generation:
        """The current configuration with its profile: what a stream opening now captures."""
        return self._gen

    def models_body(self) -> bytes:
        """The ``GET /v1/models`` answer: every configured model across all pools."""
        return self._models_body

    async def admit(self, context: RequestContext, request: InferenceRequest) -> None:
        """Run the admission hooks (:attr:`admission`) on ``request``, holding it while flow
        control does; raise a 429/503 :class:`~epp.errors.RequestError` when one refuses it.
        The verdict (budget charge, spill) is the context's. Route right after this returns
        (no await in between), so the dispatcher sees the request in flight."""
        # Bounded first: budgets, queues and the group's view keep state per flow and band.
        now = time.monotonic()
        request.fairness_id = self.flow.bound.flow(request.fairness_id, now)
        request.priority = self.flow.bound.priority(request.priority, now)
        await self.admission.admit(context, request)

    def spill(self, request: InferenceRequest, overflow: str) -> Ticket:
        """Count ``request`` in flight to ``overflow`` (released by :meth:`finish`)."""
        SPILLED.labels(request.model, overflow).inc()
        REQUESTS.add((request.model, "spilled"))
        return self.fleet.inflight.add(inflight_key(overflow), request.expected_tokens())

    async def prepare(self, request: InferenceRequest, gen: Generation | None = None) -> None:
        """Await what the profile's plugins need before scoring (a long prompt's tokens); a
        failure here only costs the request that plugin's information, never the request."""
        for plugin in (gen or self._gen).profile.prepare:
            try:
                await plugin.prepare(request, self.fleet)
            except Exception:
                log.exception(
                    "plugin %s failed to prepare request %s", plugin.name, request.request_id
                )

    def route(
        self,
        request: InferenceRequest,
        subset: Sequence[str] | None = None,
        laps: list[Lap] | None = None,
        defer: list[Callable[[], None]] | None = None,
        gen: Generation | None = None,
        rewrite: Rewrite | None = None,
    ) -> tuple[Decision, Ticket]:
        """Choose the endpoint and fallbacks, or raise :class:`~epp.errors.RequestError`.

        The returned ticket counts the request as in flight on the chosen endpoint until it is
        passed to :meth:`finish`. ``laps`` (a traced request's) receives the plugins' timings.
        With ``defer``, the profile's post-pick bookkeeping (prefix index, session binding) is
        appended to it instead of run (:meth:`Profile.run`). ``gen``: the generation the
        request's stream captured (default: the current one); which endpoints serve the model
        is always the current answer. ``rewrite``: how the request's model was rewritten, for
        the explained decision.
        """
        started = time.perf_counter()
        gen = gen or self._gen
        config = gen.config
        addresses = self._addresses(request, subset)
        snapshot = self.fleet.store.snapshot()
        candidates = [
            snapshot.endpoints.get(a) or EndpointState(a, self._pools[a]) for a in addresses
        ]
        if config.flow_control.mode != "queue":  # else counted by the flow-control hook
            self.arrived(request.model, addresses if subset is not None else None)
        # Roles, like the candidates, are the current answer (discovery changes them).
        cycle = Cycle(snapshot, self.fleet, self._capacities(config), roles=self._gen.config.roles)
        candidates = self.admission.narrow(gen, request, candidates, cycle.now)
        target = gen.target(request)
        if target is not None:
            cycle.put(LATENCY_TARGET, target)
        explain = config.routing.explain or log.isEnabledFor(logging.DEBUG)
        fallbacks = 1 + config.routing.fallbacks
        decision = gen.profile.run(request, candidates, cycle, fallbacks, explain, laps, defer)
        DECISION_SECONDS.add((), time.perf_counter() - started)
        _check(request, decision, candidates, target)
        if self.settling.any():
            self._keep_one_envoy_knows(decision, candidates)
        first = decision.endpoints[0]
        # Optional: a profile without a prefix producer counts the whole prompt as uncached.
        cached = (cycle.get(CACHED_TOKENS) or {}).get(first.address, 0)
        uncached = max(0, request.prompt_tokens() - cached)
        if gen.profile.decider is not None:
            decision = self._disaggregate(
                request, decision, uncached, addresses, cycle, gen, explain, laps, defer
            )
        ticket = self._in_flight(request, decision, cached, uncached, target, cycle.now)
        PICKS.add((first.pool, first.address))
        REQUESTS.add((request.model, "routed"))
        if decision.scores is not None:
            self._remember(request, decision, rewrite)
        return decision, ticket

    def _addresses(self, request: InferenceRequest, subset: Sequence[str] | None) -> Sequence[str]:
        """The candidates' addresses: the model's (404 when no pool serves it), only those in
        the gateway's ``subset`` hint when it gives one (503 when none is)."""
        addresses = self._candidates.get(request.model)
        if addresses is None:
            raise errors.model_not_found(request.model, list(self._candidates))
        if self._gen.config.models[request.model].lora:
            request.lora = request.model
        if subset is not None:
            allowed = set(subset)
            addresses = tuple(a for a in addresses if a in allowed)
            if not addresses:
                raise errors.no_endpoint(
                    request.model, "none of the gateway's subset hint serves it"
                )
        return addresses

    def _in_flight(
        self,
        request: InferenceRequest,
        decision: Decision,
        cached: int,
        uncached: int,
        target: LatencyTarget | None,
        now: float,
    ) -> Ticket:
        """Count the decided request in flight on its first endpoint, with what the latency
        model predicted for it there (to learn from its TTFT)."""
        first = decision.endpoints[0]
        inflight = self.fleet.inflight
        if decision.prefill is not None:
            # The decode replica loads the prompt's KV instead of prefilling it, and the
            # request's TTFT is partly another replica's: no prefill work here, and nothing
            # for the latency model to learn about this replica's prefill speed. The prefill
            # replica counts the leg until the first token (epp.state.inflight).
            return inflight.add(
                first.address,
                request.expected_tokens(cached),
                prefiller=decision.prefill.address,
                prefiller_tokens=decision.prefill_tokens,
            )
        features = ttft_features(uncached, inflight.load(first.address), first)
        predicted = self.fleet.latency.predict_ttft(first.address, features, now)
        basis = Basis(features, predicted, target, request.objective)
        return inflight.add(first.address, request.expected_tokens(cached), uncached, basis)

    def _disaggregate(
        self,
        request: InferenceRequest,
        decision: Decision,
        uncached: int,
        addresses: Sequence[str],
        cycle: Cycle,
        gen: Generation,
        explain: bool,
        laps: list[Lap] | None,
        defer: list[Callable[[], None]] | None,
    ) -> Decision:
        """``decision`` with a prefill replica when the profile's decider wants one and the
        prefill profile finds one other than the decode replica (docs/pd.md); as it is, and
        counted decode-only, otherwise. Fallbacks stay decode replicas: a retry carries the
        same prefill replica, and a failed prefill leg is prefilled by the decode replica."""
        decider, profile = gen.profile.decider, gen.prefill
        decode = decision.endpoints[0]
        prefill = None
        prefill_tokens = 0
        wanted = False
        why: dict[str, Any] = {"uncached_tokens": uncached}
        if decider is not None and profile is not None:
            wanted = decider.disaggregate(request, decode, uncached, cycle)
            if wanted:
                snapshot = cycle.snapshot
                candidates = [
                    snapshot.endpoints.get(a) or EndpointState(a, self._pools[a]) for a in addresses
                ]
                # A cycle of its own: the prefill profile's data is about prefill replicas.
                own = Cycle(snapshot, self.fleet, cycle.weights, cycle.now, roles=cycle.roles)
                picked = profile.run(request, candidates, own, 1, explain, laps, defer)
                if picked.endpoints and picked.endpoints[0].address != decode.address:
                    prefill = picked.endpoints[0]
                    hit = (own.get(CACHED_TOKENS) or {}).get(prefill.address, 0)
                    prefill_tokens = max(0, request.prompt_tokens() - hit)
                why["prefill_scores"] = picked.scores
        kind = "decode-only" if prefill is None else "prefill-decode"
        DISAGG_DECISIONS.add((kind,))
        why.update(
            decision_type=kind,
            wanted=wanted,
            prefill=None if prefill is None else prefill.address,
        )
        return replace(
            decision,
            prefill=prefill,
            prefill_tokens=prefill_tokens,
            prefill_header="" if prefill is None or decider is None else decider.header,
            disaggregation=why if explain else None,
        )

    def pass_through(self, pool: str, path: str) -> Ticket:
        """Count a request for a path that passes through to ``pool`` (``routing.passthrough``)
        in flight on the pool's least loaded ready replica that passive health admits, or raise
        a 503 :class:`~epp.errors.RequestError` when there is none. Ties rotate, so idle
        replicas share such requests instead of the first taking them all."""
        now = time.time()
        endpoints = self.fleet.store.snapshot().endpoints
        health = self.fleet.health
        ready = [
            a
            for a in self._gen.config.pools.get(pool, ())
            if (state := endpoints.get(a)) is not None and state.ready and health.admits(a, now)
        ]
        if not ready:
            raise errors.no_pool_endpoint(pool, path)
        load = self.fleet.inflight.load
        self._rotation = (self._rotation + 1) % len(ready)
        turn = self._rotation
        best = min(
            range(len(ready)), key=lambda i: (load(ready[i]).requests, (i - turn) % len(ready))
        )
        address = ready[best]
        PICKS.add((pool, address))
        REQUESTS.add(("", "passthrough"))
        return self.fleet.inflight.add(address, 0)

    def _capacities(self, config: Config) -> Mapping[str, float]:
        """Endpoint capacities for scorers: configured weights, and where a pool gives none
        the latency model's learned ones (``routing.learned_capacity``)."""
        if not config.routing.learned_capacity:
            return config.weights
        learned = self.fleet.latency.capacities(time.time())
        last_learned, last_configured, merged = self._weights
        if learned is not last_learned or config.weights is not last_configured:
            merged = {**learned, **config.weights}
            self._weights = (learned, config.weights, merged)
        return merged

    def _remember(
        self, request: InferenceRequest, decision: Decision, rewrite: Rewrite | None
    ) -> None:
        record: dict[str, Any] = {
            "request_id": request.request_id,
            "model": request.model,
            "priority": request.priority,
            "at": time.time(),
            "endpoints": [e.address for e in decision.endpoints],
            "scores": decision.scores,
        }
        if rewrite is not None:
            record["rewrite"] = rewrite.explain()
        if decision.disaggregation is not None:
            record["disaggregation"] = decision.disaggregation
        log.debug("decision %s", json.dumps(record, sort_keys=True))
        self.decisions[request.request_id] = record
        while len(self.decisions) > RECENT_DECISIONS:
            self.decisions.popitem(last=False)

    def _keep_one_envoy_knows(self, decision: Decision, candidates: list[EndpointState]) -> None:
        """When the list ends with an endpoint that joined so recently that Envoy may not have
        resolved it (epp.discovery.settling), append the least loaded ready candidate Envoy
        surely knows. Envoy walks the list forward, skipping hosts it does not know, within an
        attempt and from one retry to the next; past the list's end it fails with 503. So the
        last entry is what must be known: ``[new, new]`` and ``[old, new]`` (old fails, the
        retry reaches new) both get one appended; epp's own choices still come first."""
        chosen = decision.endpoints
        settling = self.settling.settling
        if not settling(chosen[-1].address):
            return
        picked = {e.address for e in chosen}
        load = self.fleet.inflight.load
        known = [
            c for c in candidates if c.ready and c.address not in picked and not settling(c.address)
        ]
        if known:
            chosen.append(min(known, key=lambda c: load(c.address).requests))

    def arrived(self, model: str, addresses: Sequence[str] | None = None) -> None:
        """Count a request as demand on the pools of its candidate ``addresses`` (None: all
        of ``model``'s), whether or not it can be served now: refused or held for lack of a
        ready replica, it is the demand that should scale one up."""
        if addresses is None:
            shares = self._arrival_shares[model]
        else:
            shares = _shares(addresses, self._pools)
        for pool, share in shares:
            self.demand.arrived(pool, share)

    def finish(self, ticket: Ticket) -> None:
        """The request's stream ended: its work no longer counts against the endpoint."""
        self.fleet.inflight.release(ticket)
        self.flow.wake()


def _shares(addresses: Sequence[str], pools: Mapping[str, str]) -> tuple[tuple[str, float], ...]:
    """The pools of ``addresses``, each with an equal share of one arrival."""
    names = {pools[a] for a in addresses}
    return tuple((pool, 1.0 / len(names)) for pool in names)


def _models_body(config: Config) -> bytes:
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "epp", "pools": list(spec.pools)}
        for name, spec in sorted(config.models.items())
    ]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode()


def _check(
    request: InferenceRequest,
    decision: Decision,
    candidates: Sequence[EndpointState],
    target: LatencyTarget | None,
) -> None:
    """Raise the refusal of a decision that picked no endpoint: the profile's own (a latency
    target no replica can meet), else 503 naming how many candidates are ready."""
    if decision.endpoints:
        return
    if decision.refusal is not None:
        if target is not None:
            for kind in _kinds(target):
                LATENCY_TARGETS.add((request.objective, kind, "refused"))
        raise decision.refusal
    ready = sum(1 for c in candidates if c.ready)
    raise errors.no_endpoint(request.model, f"{ready} of {len(candidates)} endpoints are ready")


def _kinds(target: LatencyTarget) -> list[str]:
    return [k for k, v in (("ttft", target.ttft), ("tpot", target.tpot)) if v is not None]
