"""In-flight load and TTFT-estimate scorers."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.config import parse_config
from epp.prefix.hashing import BlockHasher
from epp.request import InferenceRequest
from epp.router import Router
from epp.scheduling import Cycle
from epp.scheduling.prefix_data import (
    APPROX_PREFIX,
    CACHED_TOKENS,
    PRECISE_PREFIX,
    PreciseMatch,
    PrefixMatch,
    best_cached_tokens,
)
from epp.scheduling.scorers.load import InflightLoadParams, InflightLoadScorer
from epp.scheduling.scorers.ttft import TtftParams, TtftScorer
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState
from epp.state.inflight import Load
from epp.state.latency import Basis, ttft_features
from epp.state.memory import MemoryStore


def ep(addr: str, waiting: int = 0, running: int = 0) -> EndpointState:
    return EndpointState(addr, "p", True, EndpointMetrics(waiting=waiting, running=running), 1.0)


def req(prompt_chars: int = 4000, max_tokens: int = 100) -> InferenceRequest:
    return InferenceRequest(
        "r", "/v1/completions", "completions", "m", "x" * prompt_chars, max_tokens=max_tokens
    )


def test_inflight_spreads_a_burst_between_scrapes() -> None:
    """Scraped metrics say all idle; our own picks must still push the next request elsewhere."""
    fleet = FleetState()
    eps = [ep("a"), ep("b"), ep("c")]
    scorer = InflightLoadScorer()
    chosen = []
    for _ in range(6):
        cycle = Cycle(Snapshot(), fleet)
        scores = scorer.score(req(), eps, cycle)
        best = eps[max(range(3), key=lambda i: (scores[i], -i))]
        fleet.inflight.add(best.address, req().expected_tokens())
        chosen.append(best.address)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]


def test_inflight_release_restores_score() -> None:
    fleet = FleetState()
    ticket = fleet.inflight.add("a", 1000)
    scores = InflightLoadScorer().score(req(), [ep("a"), ep("b")], Cycle(Snapshot(), fleet))
    assert scores == [pytest.approx(512 / 1512), 1.0]
    fleet.inflight.release(ticket)
    assert InflightLoadScorer().score(req(), [ep("a"), ep("b")], Cycle(Snapshot(), fleet)) == [
        1.0,
        1.0,
    ]


def test_scraped_queue_counts_when_epp_did_not_route_it() -> None:
    scores = InflightLoadScorer().score(req(), [ep("a", waiting=4), ep("b")], Cycle(Snapshot()))
    assert scores == [pytest.approx(512 / (4 * 512 + 512)), 1.0]


def test_ratio_scores_near_equal_loads_alike_and_min_max_spreads_them() -> None:
    """Ten busy replicas within 10% of each other: ratio leaves the choice to other scorers,
    min-max still spans 0..1; an idle replica against a busy one is far apart either way."""
    fleet = FleetState()
    eps = [ep(f"e{i}") for i in range(10)]
    for i, e in enumerate(eps):
        fleet.inflight.add(e.address, 20_000 + 200 * i)
    cycle = Cycle(Snapshot(), fleet)
    ratio = InflightLoadScorer().score(req(), eps, cycle)
    assert min(ratio) > 0.9
    assert max(ratio) == 1.0
    minmax = InflightLoadScorer(InflightLoadParams(normalise="min-max")).score(req(), eps, cycle)
    assert (min(minmax), max(minmax)) == (0.0, 1.0)
    idle_vs_busy = InflightLoadScorer().score(req(), [ep("idle"), eps[0]], cycle)
    assert idle_vs_busy[1] < 0.03


def test_scraped_requests_count_at_the_size_of_epps_own() -> None:
    """Two tiny requests of epp's own and a scraped queue of 6: the queue is 6 tiny requests,
    not 6 x 512 tokens, so a replica holding many small requests is not shunned for it."""
    fleet = FleetState()
    for _ in range(2):
        fleet.inflight.add("a", 10)
    fleet.inflight.add("b", 100)
    cycle = Cycle(Snapshot(), fleet)
    scorer = InflightLoadScorer(InflightLoadParams(normalise="min-max"))
    assert scorer.score(req(), [ep("a", running=6), ep("b")], cycle) == [1.0, 0.0]


def test_capacity_weight_divides_load() -> None:
    fleet = FleetState()
    fleet.inflight.add("fast", 1000)
    fleet.inflight.add("slow", 600)
    cycle = Cycle(Snapshot(), fleet, weights={"fast": 2.0})
    scorer = InflightLoadScorer(InflightLoadParams(normalise="min-max"))
    assert scorer.score(req(), [ep("fast"), ep("slow")], cycle) == [1.0, 0.0]


def test_ttft_trades_cache_hits_against_queued_prefill() -> None:
    # 1000-token prompt; "warm" has 900 tokens cached but was just sent a 300-token prefill.
    scorer = TtftScorer(TtftParams(prefill_tokens_per_second=1000))
    fleet = FleetState()  # the backlog lives in the fleet state, not on the scorer
    prefill_300 = req(300 * 4 - 4)
    scorer.on_pick(prefill_300, ep("warm"), Cycle(Snapshot(), fleet, now=100.0))
    cycle = Cycle(Snapshot(), fleet, now=100.0)
    cycle.put(CACHED_TOKENS, {"warm": 900})
    warm, cold = scorer.score(req(4000), [ep("warm"), ep("cold")], cycle)
    assert warm == 1.0  # 300 + 101 tokens of work beats 1001
    assert cold == pytest.approx((401 + 64) / (1001 + 64))
    # A heavy queue of prefill on the warm replica flips the choice...
    scorer.on_pick(req(5000 * 4 - 4), ep("warm"), Cycle(Snapshot(), fleet, now=100.0))
    warm, cold = scorer.score(req(4000), [ep("warm"), ep("cold")], cycle)
    assert cold == 1.0
    assert warm < 0.5
    # ...until the replica has had time to compute it (5,300 tokens at 1,000/s).
    later = Cycle(Snapshot(), fleet, now=105.3)
    later.put(CACHED_TOKENS, {"warm": 900})
    assert scorer.score(req(4000), [ep("warm"), ep("cold")], later)[0] == 1.0


def test_ttft_ignores_decoding_work_but_not_the_waiting_queue() -> None:
    """Requests decoding after a cache hit do not delay a new prompt much; waiting ones do."""
    fleet = FleetState()
    for _ in range(20):
        fleet.inflight.add("busy", 300)
    cycle = Cycle(Snapshot(), fleet)
    cycle.put(CACHED_TOKENS, {"busy": 900})
    scores = TtftScorer().score(req(4000), [ep("busy", running=20), ep("idle")], cycle)
    assert scores[0] == 1.0
    scores = TtftScorer().score(req(4000), [ep("busy", waiting=4), ep("idle")], cycle)
    assert scores[1] == 1.0


def test_capacity_drains_the_prefill_queue_faster() -> None:
    scorer = TtftScorer(TtftParams(prefill_tokens_per_second=1000))
    fleet = FleetState()
    for address in ("fast", "slow"):
        scorer.on_pick(req(4000 * 4 - 4), ep(address), Cycle(Snapshot(), fleet, now=0.0))
    cycle = Cycle(Snapshot(), fleet, weights={"fast": 2.0}, now=1.0)
    assert scorer.backlog("fast", cycle) == pytest.approx(2000)
    assert scorer.backlog("slow", cycle) == pytest.approx(3000)


def learn(fleet: FleetState, rates: dict[str, float], now: float) -> None:
    """Teach the fleet's latency model each endpoint's prefill rate (tokens/s) from cold
    requests of 500-3,000 tokens, as the response path would."""
    for address, rate in rates.items():
        for i in range(30):
            uncached = 500.0 + 100 * i
            features = ttft_features(uncached, Load(), ep(address))
            at = now - 3 + i / 10
            fleet.latency.observe_ttft(address, Basis(features, 0.0), 0.02 + uncached / rate, at)


def test_ttft_sends_a_cold_prompt_to_the_replica_that_learned_to_prefill_faster() -> None:
    """Equal loads, nothing cached: the token count ties; the learned speeds do not."""
    fleet = FleetState()
    learn(fleet, {"fast": 10_000, "slow": 5_000}, 100.0)
    cycle = Cycle(Snapshot(), fleet, now=100.0)
    on = TtftScorer()  # learned_speed on: the default
    fast, slow = on.score(req(8000), [ep("fast"), ep("slow")], cycle)
    assert fast == 1.0
    assert slow == pytest.approx(0.5, abs=0.1)
    # Off, every unweighted endpoint counts as 1; on is the default.
    off = TtftScorer(TtftParams(learned_speed=False))
    assert off.score(req(8000), [ep("fast"), ep("slow")], cycle) == [1.0, 1.0]
    # A configured weight overrides what was learned.
    weighted = Cycle(Snapshot(), fleet, weights={"slow": 4.0}, now=100.0)
    assert on.score(req(8000), [ep("fast"), ep("slow")], weighted)[1] == 1.0
    # Learned speed drains the prefill queue too: 4,000 tokens at 10k x ~1.3 in 0.1 s.
    scorer = TtftScorer(TtftParams(learned_speed=True))
    for address in ("fast", "slow"):
        scorer.on_pick(req(4000 * 4 - 4), ep(address), Cycle(Snapshot(), fleet, now=100.0))
    later = Cycle(Snapshot(), fleet, now=100.1)
    assert scorer.backlog("fast", later) < scorer.backlog("slow", later) - 500


def test_ttft_picks_on_equal_replicas_do_not_change_with_what_was_learned() -> None:
    """Replicas that learned the same rate (within noise) score as if nothing was learned."""
    fleet = FleetState()
    learn(fleet, {"a": 10_000, "b": 9_500, "c": 10_500}, 100.0)
    scorer = TtftScorer(TtftParams(learned_speed=True))
    eps = [ep("a"), ep("b"), ep("c")]
    scorer.on_pick(req(2000), ep("b"), Cycle(Snapshot(), fleet, now=100.0))
    cycle = Cycle(Snapshot(), fleet, now=100.01)
    plain = Cycle(Snapshot(), FleetState(), now=100.01)
    scorer.on_pick(req(2000), ep("b"), Cycle(Snapshot(), plain.fleet, now=100.0))
    scores = scorer.score(req(8000), eps, cycle)
    assert scores == scorer.score(req(8000), eps, plain)
    assert scores[0] == scores[2] == 1.0 > scores[1]  # the prefill sent to b still counts


def test_precise_cached_tokens_win_over_approximate() -> None:
    cycle = Cycle(Snapshot(), FleetState())
    cycle.put(APPROX_PREFIX, PrefixMatch(BlockHasher(), [1], 16, cached_tokens={"a": 1000}))
    unknown = PreciseMatch(None, None, 8)  # the prompt's engine ids are not known
    cycle.put(PRECISE_PREFIX, unknown)
    assert best_cached_tokens(cycle) == {"a": 1000}
    cycle.put(PRECISE_PREFIX, PreciseMatch((1,) * 64, None, 8, cached_tokens={"b": 1000}))
    assert best_cached_tokens(cycle) == {"b": 1000}
    cycle.put(CACHED_TOKENS, best_cached_tokens(cycle))
    a, b = TtftScorer().score(req(4000), [ep("a"), ep("b")], cycle)
    assert b == 1.0
    assert a < 0.2


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="tokens_per_request"):
        TtftScorer(TtftParams(tokens_per_request=0))
    with pytest.raises(ValueError, match="tokens_per_request"):
        InflightLoadScorer(InflightLoadParams(tokens_per_request=-1))
    with pytest.raises(ValueError, match="normalise"):
        InflightLoadScorer(InflightLoadParams(normalise="z-score"))
    with pytest.raises(ValueError, match="prefill_tokens_per_second"):
        TtftScorer(TtftParams(prefill_tokens_per_second=0))


BIG, S1, S2 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


async def test_default_profile_gives_a_weighted_replica_its_share_of_a_burst() -> None:
    """Configured capacity 2:1:1 and 200 distinct prompts held in flight (nothing finishes):
    the default profile puts half of them on the double-capacity replica."""
    config = parse_config(
        {
            "models": {"m": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [{"address": BIG, "weight": 2}, S1, S2]}},
        }
    )
    store = MemoryStore()
    for address in (BIG, S1, S2):
        await store.put_endpoint(EndpointState(address, "main", True, EndpointMetrics(), 1.0))
    router = Router(config, FleetState(store))
    counts: Counter[str] = Counter()
    for i in range(200):
        request = InferenceRequest("r", "/v1/completions", "completions", "m", f"{i} " * 300)
        decision, _ = router.route(request)
        counts[decision.endpoints[0].address] += 1
    assert 90 <= counts[BIG] <= 110, counts
    assert abs(counts[S1] - counts[S2]) <= 10, counts
