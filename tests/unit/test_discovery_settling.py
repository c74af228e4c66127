"""Right after a DNS scale-up, epp's list keeps one endpoint Envoy has surely resolved."""

from __future__ import annotations

from dataclasses import replace

from epp.config import parse_config
from epp.discovery.settling import SETTLE_INTERVALS, Settling
from epp.discovery.spec import DnsSpec, StaticSpec
from epp.extproc.stream import StreamHandler
from epp.request import InferenceRequest
from epp.router import Router
from epp.state import EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.state.snapshot import EndpointMetrics
from epp.wire import SERVED
from tests.unit.test_response_stream import SSE_HEADERS, _response_headers
from tests.unit.test_stream import body_msg, headers_msg

OLD = ("10.0.0.1:8000", "10.0.0.2:8000")
NEW = ("10.0.0.3:8000", "10.0.0.4:8000")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_new_members_settle_for_some_intervals_and_first_members_are_known() -> None:
    clock = Clock()
    settling = Settling(clock)
    interval = 1.0
    dns = {"main": DnsSpec("sim", 8000, interval=interval)}
    settling.update({"main": ()}, dns)  # discovery has not answered yet
    settling.update({"main": OLD}, dns)
    assert not settling.any()
    settling.update({"main": OLD + NEW}, dns)
    assert all(settling.settling(a) for a in NEW)
    assert not any(settling.settling(a) for a in OLD)
    clock.now += SETTLE_INTERVALS * interval - 0.01
    assert settling.settling(NEW[0])
    clock.now += 0.02
    assert not settling.settling(NEW[0])
    assert not settling.settling(NEW[1])
    assert not settling.any()


def test_static_pools_and_departed_endpoints_never_settle() -> None:
    settling = Settling(Clock())
    static = {"main": StaticSpec(OLD)}
    settling.update({"main": OLD}, static)
    settling.update({"main": OLD + NEW}, static)
    assert not settling.any()
    dns = {"main": DnsSpec("sim", 8000)}
    settling.update({"main": OLD}, dns)
    settling.update({"main": OLD + NEW}, dns)
    settling.update({"main": OLD}, dns)  # scaled back down before Envoy saw them
    assert not settling.any()


async def _router(waiting: dict[str, int] | None = None) -> Router:
    """A router that has just seen NEW join OLD, with these queues (default: the old replicas
    busy and the new ones idle, so that every scorer prefers the new two)."""
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"discovery": {"dns": {"name": "sim", "port": 8000}}}},
            "routing": {"fallbacks": 1},
        }
    )
    store = MemoryStore()
    queues = waiting or {a: 8 for a in OLD}
    for address in OLD + NEW:
        metrics = EndpointMetrics(waiting=queues.get(address, 0), running=4)
        await store.put_endpoint(EndpointState(address, "main", True, metrics, 1.0))
    router = Router(replace(config, pools={"main": OLD}), FleetState(store))
    router.config = replace(config, pools={"main": OLD + NEW})
    return router


def _pick_new(router: Router) -> tuple[StreamHandler, str]:
    """A request through a stream handler, routed to one of the new replicas (which
    ``_router`` makes every scorer prefer); the handler and the picked replica."""
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    handler.handle(body_msg(b'{"model": "tiny", "prompt": "hello"}'))
    assert handler.ticket is not None
    picked = handler.ticket.endpoint
    assert picked in NEW
    return handler, picked


async def test_a_list_of_only_new_replicas_gets_an_old_one_appended() -> None:
    router = await _router()
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", "hello")
    decision, ticket = router.route(request)
    addresses = [e.address for e in decision.endpoints]
    assert set(addresses[:2]) == set(NEW), addresses  # epp's own choice is unchanged
    assert len(addresses) == 3, addresses
    assert addresses[2] in OLD, addresses
    assert ticket.endpoint == addresses[0]


async def test_a_list_ending_with_a_new_replica_gets_an_old_one_appended() -> None:
    """``[old, new]``: should the old one fail, Envoy's retry walks on to the new one, which
    it may not know; past the list's end it would answer 503."""
    router = await _router({OLD[0]: 0, NEW[0]: 2, OLD[1]: 8, NEW[1]: 8})
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", "hello")
    decision, _ = router.route(request)
    addresses = [e.address for e in decision.endpoints]
    assert addresses == [OLD[0], NEW[0], OLD[1]], addresses


async def test_a_list_ending_with_an_old_replica_is_left_alone() -> None:
    router = await _router({NEW[0]: 0, OLD[0]: 2, OLD[1]: 8, NEW[1]: 8})
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", "hello")
    decision, _ = router.route(request)
    assert [e.address for e in decision.endpoints] == [NEW[0], OLD[0]]


async def test_once_settled_the_list_is_epps_choice_alone() -> None:
    router = await _router()
    router.settling = Settling(lambda: 1e12)  # long after the scale-up
    router.settling.update({"main": OLD + NEW}, {"main": DnsSpec("sim", 8000)})
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", "hello")
    decision, _ = router.route(request)
    assert {e.address for e in decision.endpoints} == set(NEW)


def test_a_response_served_by_a_new_member_ends_its_settling_at_once() -> None:
    settling = Settling(Clock())
    dns = {"main": DnsSpec("sim", 8000, interval=1.0)}
    settling.update({"main": OLD}, dns)
    settling.update({"main": OLD + NEW}, dns)
    settling.served(NEW[0])
    settling.served(OLD[0])  # known all along: nothing to end
    assert not settling.settling(NEW[0])
    assert settling.settling(NEW[1])
    settling.update({"main": OLD + NEW}, dns)  # the next resolution does not restart it
    assert not settling.settling(NEW[0])


async def test_envoy_serving_a_new_replica_ends_its_settling() -> None:
    """The served endpoint on the response path is the evidence that Envoy has resolved a
    new replica: from then on lists ending with it are epp's choice alone."""
    router = await _router()  # NEW have just joined, and every scorer prefers them
    handler, picked = _pick_new(router)
    handler.handle(_response_headers({**SSE_HEADERS, SERVED: picked}))
    assert not router.settling.settling(picked)
    other = next(a for a in NEW if a != picked)
    assert router.settling.settling(other)
    router.finish(handler.ticket)


async def test_a_settling_replica_envoy_skipped_is_not_judged_failed() -> None:
    """Envoy's ``override_host`` skips an address its cluster lacks without trying it, so a
    request picked for a replica that has just joined is served by the next one in the list.
    That is not a failed attempt of the new replica: counted as one, a scale-up's new replicas
    were ejected (consecutive failures) before Envoy had ever resolved them. Once settled, the
    same move is a retry and counts against the picked replica."""
    router = await _router()  # NEW have just joined
    for settled in (False, True):
        if settled:
            router.settling = Settling()  # nothing joined recently
        handler, picked = _pick_new(router)
        handler.handle(_response_headers({**SSE_HEADERS, SERVED: OLD[0]}))
        state = router.fleet.health.state(picked)
        failures = [failed for _, failed in state.outcomes] if state is not None else []
        assert failures == ([True] if settled else [])
        router.finish(handler.ticket)
