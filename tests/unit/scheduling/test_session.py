"""Session table and session-affinity-scorer."""

from __future__ import annotations

import pytest

from epp.scheduling import Profile
from epp.scheduling.filters.ready import ReadyEndpointFilter
from epp.scheduling.pickers.max_score import MaxScoreParams, MaxScorePicker
from epp.scheduling.scorers.session import SESSIONS, SessionAffinityScorer, SessionParams
from epp.state import EndpointState
from epp.state.fleet import FleetState
from epp.state.sessions import SessionTable
from tests.unit.scheduling.common import cycle, ep, req

EPS = [ep("a"), ep("b"), ep("c")]


def test_table_binds_expires_and_refreshes() -> None:
    table = SessionTable()
    table.bind("s", "a", now=0.0, ttl=10.0)
    assert table.get("s", now=9.9) == "a"
    assert table.get("s", now=10.0) is None
    assert len(table) == 0
    table.bind("s", "a", now=20.0, ttl=10.0)
    table.bind("s", "b", now=25.0, ttl=10.0)  # refresh (and move)
    assert table.get("s", now=34.0) == "b"
    assert table.get("unknown", now=0.0) is None


def test_table_is_bounded_least_recently_bound_first() -> None:
    table = SessionTable(max_sessions=2)
    table.bind("s1", "a", 0.0, 100.0)
    table.bind("s2", "a", 1.0, 100.0)
    table.bind("s1", "b", 2.0, 100.0)  # s1 is now the most recent
    table.bind("s3", "c", 3.0, 100.0)
    assert len(table) == 2
    assert table.get("s2", 4.0) is None
    assert table.get("s1", 4.0) == "b"


def test_table_clears_expired_bindings_as_it_goes() -> None:
    table = SessionTable()
    for i in range(100):
        table.bind(f"s{i}", "a", now=float(i), ttl=5.0)
    assert len(table) == 5


def test_requests_without_session_score_zero_and_are_not_recorded() -> None:
    fleet = FleetState()
    scorer = SessionAffinityScorer()
    assert scorer.score(req("x"), EPS, cycle(fleet)) == [0.0, 0.0, 0.0]
    scorer.on_pick(req("x"), EPS[0], cycle(fleet))
    assert len(fleet.states.get(SESSIONS)) == 0


def route(
    profile: Profile, fleet: FleetState, eps: list[EndpointState], now: float, session: str = "s"
) -> str:
    request = req("x", session=session)
    return profile.run(request, eps, cycle(fleet, now=now), count=1).endpoints[0].address


@pytest.fixture
def profile() -> Profile:
    scorer = SessionAffinityScorer(SessionParams(ttl_seconds=60, max_waiting=4, max_kv_usage=0.9))
    return Profile(
        "t",
        [ReadyEndpointFilter()],
        [(scorer, 1.0)],
        MaxScorePicker(MaxScoreParams(seed=5)),
        [scorer],
    )


def test_session_sticks_and_each_pick_refreshes_its_ttl(profile: Profile) -> None:
    fleet = FleetState()
    first = route(profile, fleet, EPS, now=0.0)
    # 20 requests 50 s apart: each within the TTL of the previous one.
    assert {route(profile, fleet, EPS, now=50.0 * i) for i in range(1, 21)} == {first}
    assert fleet.states.get(SESSIONS).get("s", 1000.0) == first
    # Another session is independent (random ties spread new sessions).
    assert len({route(profile, fleet, EPS, 1000.0, session=f"o{i}") for i in range(30)}) > 1


def test_session_expires_after_ttl(profile: Profile) -> None:
    fleet = FleetState()
    fleet.states.get(SESSIONS).bind("s", "a", now=0.0, ttl=60.0)
    scorer = profile.scorers[0][0]
    assert scorer.score(req("x", session="s"), EPS, cycle(fleet, now=59.0)) == [1.0, 0.0, 0.0]
    assert scorer.score(req("x", session="s"), EPS, cycle(fleet, now=61.0)) == [0.0, 0.0, 0.0]


def test_session_moves_when_its_endpoint_is_unready(profile: Profile) -> None:
    fleet = FleetState()
    fleet.states.get(SESSIONS).bind("s", "a", now=0.0, ttl=60.0)
    moved = route(profile, fleet, [ep("a", ready=False), ep("b"), ep("c")], now=1.0)
    assert moved != "a"
    # It then sticks to its new endpoint, even once "a" is back.
    assert {route(profile, fleet, EPS, now=2.0 + i) for i in range(10)} == {moved}


@pytest.mark.parametrize("overload", [{"waiting": 4}, {"kv_usage": 0.9}])
def test_session_moves_off_an_overloaded_endpoint(
    profile: Profile, overload: dict[str, float]
) -> None:
    fleet = FleetState()
    fleet.states.get(SESSIONS).bind("s", "a", now=0.0, ttl=60.0)
    scorer = profile.scorers[0][0]
    busy = [ep("a", **overload), ep("b"), ep("c")]
    assert scorer.score(req("x", session="s"), busy, cycle(fleet, now=1.0)) == [0.0, 0.0, 0.0]
    fine = [ep("a", waiting=3, kv_usage=0.89), ep("b"), ep("c")]
    assert scorer.score(req("x", session="s"), fine, cycle(fleet, now=1.0)) == [1.0, 0.0, 0.0]


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="ttl"):
        SessionAffinityScorer(SessionParams(ttl_seconds=0))
    with pytest.raises(ValueError, match="max_kv_usage"):
        SessionAffinityScorer(SessionParams(max_kv_usage=1.5))
