"""Plugin-owned long-lived state: keys, one instance per parameter set, retry moves, reloads."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, NamedTuple

from epp.config import Config, parse_config
from epp.prefix.approximate import APPROX_PREFIX, approx_prefix
from epp.prefix.hashing import BlockHasher
from epp.prefix.precise import PRECISE_INDEX, chain_keys, root_key
from epp.request import InferenceRequest
from epp.router import Router
from epp.scheduling.scorers.no_hit_lru import COLD_PICKS
from epp.scheduling.scorers.prefix import PrefixCacheScorer, PrefixParams
from epp.scheduling.scorers.session import SESSIONS
from epp.scheduling.scorers.ttft import PREFILL_BACKLOG
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.state.moves import PickRecord, Recording, move_pick
from epp.state.registry import StateKey, States
from tests.unit.scheduling.common import cycle, ep, profile_of, req, scored, text

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
EPS = [ep(A), ep(B)]


def test_one_instance_per_name_and_parameters() -> None:
    states = States()
    made: list[list[int]] = []

    def factory() -> list[int]:
        made.append([])
        return made[-1]

    first = states.get(StateKey("counts", factory, (1,)))
    assert states.get(StateKey("counts", factory, (1,))) is first
    other = states.get(StateKey("counts", factory, (2,)))
    assert other is not first
    assert len(made) == 2
    assert states.named("counts") == [first, other]
    assert states.named("else") == []


def test_tag_carries_the_parameters_except_for_the_default_prefix_index() -> None:
    # The default keeps the tag earlier releases ship the index under (rolling upgrades).
    assert approx_prefix().tag == "prefix"
    assert approx_prefix(BlockHasher(block_chars=32)).tag == "approx-prefix:32:16"
    assert StateKey("x", list, (1, "a")).tag == "x:1:a"
    assert StateKey("x", list, (1,), tag="y").tag == "y"


def test_only_parameters_that_change_a_hash_key_the_index() -> None:
    assert approx_prefix(BlockHasher(max_blocks=8)) == approx_prefix()  # a shorter chain only
    assert approx_prefix(BlockHasher(block_chars=32)) != approx_prefix()
    assert approx_prefix(BlockHasher(block_size=32)) != approx_prefix()


def test_scorers_with_other_block_sizes_never_see_each_others_entries() -> None:
    fleet = FleetState()
    prompt = req(text("p", 64 * 4))
    small = PrefixCacheScorer(PrefixParams(block_chars=32))
    default = PrefixCacheScorer()
    c = cycle(fleet)
    scored(small, prompt, EPS, c)
    small.on_pick(prompt, EPS[0], c)
    # The small-block scorer's pick taught its own index only.
    assert fleet.states.get(approx_prefix(BlockHasher(block_chars=32))).size(A) == 8
    assert fleet.states.get(approx_prefix()).size(A) == 0
    assert scored(default, prompt, EPS, cycle(fleet)) == [0.0, 0.0]
    assert scored(small, prompt, EPS, cycle(fleet)) == [1.0, 0.0]
    assert len(fleet.states.named(APPROX_PREFIX)) == 2


def test_applying_a_profile_declares_its_states_before_any_request() -> None:
    fleet = FleetState()
    profile_of(("prefix-cache-scorer", PrefixParams(block_chars=128), None)).declare(fleet)
    (index,) = fleet.states.named(APPROX_PREFIX)
    assert index is fleet.states.get(approx_prefix(BlockHasher(block_chars=128)))


def test_a_retry_moves_what_every_journaled_state_recorded() -> None:
    fleet = FleetState()
    # Both declared, as applying a configuration does, before the pick is recorded.
    default = fleet.states.get(approx_prefix())
    small = fleet.states.get(approx_prefix(BlockHasher(block_chars=32)))
    with Recording(fleet.states) as learned:
        default.insert(A, [1, 2], 100)
        small.insert(A, [7, 8, 9], 100)
    assert [(item.endpoint, item.hashes) for item in learned] == [(A, [1, 2]), (A, [7, 8, 9])]
    record = PickRecord(fleet.inflight.add(A, 10), learned)
    moved = move_pick(fleet, record, B, 0.0)
    assert default.match([1, 2], [A, B]) == {A: 0, B: 2}
    assert small.match([7, 8, 9], [A, B]) == {A: 0, B: 3}
    assert [item.endpoint for item in moved.learned] == [B, B]
    # Nothing is journaled outside a recording.
    assert fleet.states.journaled == [default, small]
    assert all(s.journal is None for s in fleet.states.journaled)


# Every scorer that keeps a state, besides the prefix scorer whose block size a test changes.
STATEFUL = (
    "session-affinity-scorer",
    "ttft-scorer",
    "no-hit-lru-scorer",
    "precise-prefix-cache-scorer",
)
BLOCK = 16
IDS = tuple(range(1, 4 * BLOCK + 1))  # four blocks of token ids, for both prefix indexes


def _config(block_chars: int) -> Config:
    prefix = {"plugin": "prefix-cache-scorer", "parameters": {"block_chars": block_chars}}
    return parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [{"address": a} for a in (A, B)]}},
            "scheduling": {
                "profile": "p",
                "profiles": {
                    "p": [
                        prefix,
                        *({"plugin": p} for p in STATEFUL),
                        {"plugin": "max-score-picker"},
                    ]
                },
            },
        }
    )


async def _router(block_chars: int) -> Router:
    store = MemoryStore()
    for address in (A, B):
        metrics = EndpointMetrics(block_size=BLOCK)
        await store.put_endpoint(EndpointState(address, "main", True, metrics, scraped_at=1.0))
    return Router(_config(block_chars), FleetState(store))


def _request(prompt: str = "", session: str | None = None) -> InferenceRequest:
    ids = None if prompt else IDS
    return InferenceRequest(
        "id",
        "/v1/completions",
        "completions",
        "tiny",
        prompt,
        prompt_token_ids=ids,
        session=session,
    )


async def test_a_reload_keeps_every_state_and_a_changed_key_starts_a_fresh_one() -> None:
    router = await _router(64)
    states = router.fleet.states
    prompt = text("p", 64 * 4)
    decision, _ = router.route(_request(prompt, session="s"))
    picked = decision.endpoints[0].address
    default = states.get(approx_prefix())
    sessions, backlog = states.get(SESSIONS), states.get(PREFILL_BACKLOG)
    learned = (default.size(picked), sessions.get("s", time.time()), backlog.get(picked))
    assert learned[:2] == (4, picked)
    assert learned[2] is not None

    # The same file again: new plugin instances, the same states with their content.
    profile = router.generation.profile
    router.config = _config(64)
    assert router.generation.profile is not profile
    assert (states.get(SESSIONS), states.get(PREFILL_BACKLOG)) == (sessions, backlog)
    assert (default.size(picked), sessions.get("s", time.time()), backlog.get(picked)) == learned

    # Another block size keys another index: declared by the reload, empty, so nothing learned
    # under 64-byte blocks is matched by it; the unkeyed states are the same instances.
    router.config = _config(32)
    small = states.get(approx_prefix(BlockHasher(block_chars=32)))
    assert small.size(picked) == 0
    assert len(states.named(APPROX_PREFIX)) == 2
    assert (states.get(SESSIONS), states.get(PREFILL_BACKLOG)) == (sessions, backlog)
    assert (sessions.get("s", time.time()), backlog.get(picked)) == learned[1:]
    router.route(_request(prompt))
    assert sum(small.size(e) for e in (A, B)) == 8
    assert default.size(picked) == 4  # kept, untouched


class _Mark(NamedTuple):
    """A footprint of :class:`_Marks`: one mark of ``endpoint``."""

    endpoint: str
    owner: _Marks

    def move(self, served: str, _now: float) -> None:
        self.owner.counts[self.endpoint] -= 1
        self.owner.mark(served)


class _Marks:
    """A state of the test's own, journaling each mark like a state that moves."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.journal: list[Any] | None = None

    def mark(self, endpoint: str) -> None:
        self.counts[endpoint] += 1
        if self.journal is not None:
            self.journal.append(_Mark(endpoint, self))


MOVING = StateKey("test-moving", _Marks, moves=True)
STAYING = StateKey("test-staying", _Marks)  # journal-shaped, but not declared to move


async def test_a_retry_moves_every_state_declared_to_move_and_no_other() -> None:
    router = await _router(64)
    fleet, states = router.fleet, router.fleet.states
    moving, staying = states.get(MOVING), states.get(STAYING)
    moves = [states.get(k) for k in (approx_prefix(), SESSIONS, MOVING)]
    assert sorted(map(id, states.journaled)) == sorted(map(id, moves))
    with Recording(states) as learned:
        decision, ticket = router.route(_request(session="s"))
        picked = decision.endpoints[0].address
        moving.mark(picked)
        staying.mark(picked)
    served = B if picked == A else A
    backlog = states.get(PREFILL_BACKLOG).get(picked)
    keys = chain_keys(IDS, BLOCK, root_key(None))
    precise = states.get(PRECISE_INDEX)
    assert precise.match(keys, [picked, served], time.time()) == {picked: 4, served: 0}

    moved = move_pick(fleet, PickRecord(ticket, learned), served, time.time())

    index = states.get(approx_prefix())
    assert (index.size(picked), index.size(served)) == (0, 4)
    assert states.get(SESSIONS).get("s", time.time()) == served
    assert +moving.counts == {served: 1}
    assert {item.endpoint for item in moved.learned} == {served}
    # The states not declared to move stay where the pick put them.
    assert staying.counts == {picked: 1}
    assert staying.journal is None
    assert states.get(PREFILL_BACKLOG).get(picked) == backlog
    assert states.get(PREFILL_BACKLOG).get(served) is None
    assert states.get(COLD_PICKS).ranks([picked, served]) == [1, 0]
    assert precise.match(keys, [picked, served], time.time()) == {picked: 4, served: 0}
    assert fleet.inflight.load(served).requests == 1
