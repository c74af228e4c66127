"""Plugin-owned long-lived state: keys, one instance per parameter set, retry moves, reloads."""

from __future__ import annotations

from epp.config import Config, parse_config
from epp.prefix.approximate import APPROX_PREFIX, approx_prefix
from epp.prefix.hashing import BlockHasher
from epp.request import InferenceRequest
from epp.router import Router
from epp.scheduling.scorers.prefix import PrefixCacheScorer, PrefixParams
from epp.state import EndpointState
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


def _config(block_chars: int) -> Config:
    return parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": [{"address": a} for a in (A, B)]}},
            "scheduling": {
                "profile": "p",
                "profiles": {
                    "p": [
                        {
                            "plugin": "prefix-cache-scorer",
                            "parameters": {"block_chars": block_chars},
                        },
                        {"plugin": "max-score-picker"},
                    ]
                },
            },
        }
    )


def _request(prompt: str) -> InferenceRequest:
    return InferenceRequest("id", "/v1/completions", "completions", "tiny", prompt)


async def test_a_reload_that_changes_the_block_size_starts_another_index() -> None:
    store = MemoryStore()
    for address in (A, B):
        await store.put_endpoint(EndpointState(address, "main", True, scraped_at=1.0))
    router = Router(_config(64), FleetState(store))
    prompt = text("p", 64 * 4)
    decision, _ = router.route(
        InferenceRequest("1", "/v1/completions", "completions", "tiny", prompt)
    )
    picked = decision.endpoints[0].address
    assert router.fleet.states.get(approx_prefix()).size(picked) == 4
    router.config = _config(32)
    small = router.fleet.states.get(approx_prefix(BlockHasher(block_chars=32)))
    # Declared by the reload, empty: nothing learned under 64-byte blocks is matched by it.
    assert small.size(picked) == 0
    assert len(router.fleet.states.named(APPROX_PREFIX)) == 2
    router.route(_request(prompt))
    assert sum(small.size(e) for e in (A, B)) == 8
    assert router.fleet.states.get(approx_prefix()).size(picked) == 4  # kept, untouched
