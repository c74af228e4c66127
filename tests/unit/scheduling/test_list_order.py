"""A profile is a set: shuffling the plugin list of any shipped profile changes nothing.

Every profile epp ships (the built-in default, the benchmark profiles, the examples in the README
and docs) is shuffled many times; each shuffle routes the same requests over the same warm fleet
(approximate and precise prefix state, sessions, in-flight work, a prefill backlog) and must give
the same endpoints and the same per-plugin weighted scores as the profile as written.
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config import DEFAULT_PROFILE, parse_config
from epp.prefix.approximate import approx_prefix
from epp.prefix.hashing import BlockHasher
from epp.prefix.precise import PRECISE_INDEX
from epp.request import InferenceRequest
from epp.roles import Role
from epp.scheduling import Cycle, PluginSpec, Profile, build_profile
from epp.scheduling.pickers.max_score import MaxScoreParams
from epp.scheduling.scorers.session import SESSIONS
from epp.scheduling.scorers.ttft import PREFILL_BACKLOG
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState
from tests.unit.extending import least_picked  # noqa: F401  (docs/extending.md configures it)
from tests.unit.scheduling.common import text

ROOT = Path(__file__).resolve().parents[3]
SHUFFLES = 25
NOW = 10_000.0
BS = 16

EPS = [f"10.0.0.{i}:8000" for i in range(1, 9)]
BASE: dict[str, Any] = {
    "models": {"m": {"pools": ["p"]}},
    "pools": {"p": {"endpoints": [{"address": EPS[0], "weight": 2}, *EPS[1:]]}},
}


# Two prefill replicas, for the prefill/decode profiles' role filters (others ignore roles).
ROLES: dict[str, Role] = {EPS[5]: "prefill", EPS[6]: "prefill"}

# (declarations, the profile's list, every profile of its file: a decider names another one)
Shipped = tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]


def shipped_profiles() -> dict[str, Shipped]:
    """Every profile shipped in code, benchmark profiles, and docs or envoy examples: its
    ``scheduling.plugins`` declarations and its list."""
    found: dict[str, Shipped] = {"epp.config.DEFAULT_PROFILE": ([], DEFAULT_PROFILE, {})}
    sources: list[tuple[str, Any]] = []
    for path in sorted((ROOT / "benchmarks" / "profiles").rglob("*.yaml")):
        sources.append((path.name, yaml.safe_load(path.read_text()).get("epp")))
    for path in sorted((ROOT / "envoy").glob("*epp*.yaml")):
        sources.append((path.name, yaml.safe_load(path.read_text())))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(), re.DOTALL)
        sources.extend((f"{path.name} block {i}", yaml.safe_load(b)) for i, b in enumerate(blocks))
    for where, data in sources:
        scheduling = (data or {}).get("scheduling") if isinstance(data, dict) else None
        if scheduling is None:
            continue  # runs the built-in default, already listed
        declared = scheduling.get("plugins") or []
        profiles = scheduling.get("profiles") or {}
        for name, entries in profiles.items():
            found[f"{where}: {name}"] = (declared, entries, profiles)
    return found


PROFILES = shipped_profiles()


def test_every_kind_of_shipped_profile_is_found() -> None:
    assert "benchmarks/profiles" not in PROFILES  # keys are file names
    names = " ".join(PROFILES)
    for expected in (
        "DEFAULT_PROFILE",
        "epp-precise",
        "gie-default",
        "configuration.md",
        "scheduling.md",
    ):
        assert expected in names, names


def built(
    entries: list[dict[str, Any]],
    declared: list[dict[str, Any]] | None = None,
    others: dict[str, Any] | None = None,
) -> Profile:
    profiles = {**(others or {}), "p": entries}
    scheduling = {"profile": "p", "plugins": declared or [], "profiles": profiles}
    spec = parse_config({**BASE, "scheduling": scheduling}).scheduling.selected
    # A fixed tie-break, so that only list order could tell two runs apart.
    seeded = tuple(
        dataclasses.replace(p, params=MaxScoreParams(seed=11))
        if p.type_name == "max-score-picker"
        else p
        for p in spec.plugins
    )
    return build_profile(dataclasses.replace(spec, plugins=seeded))


def snapshot() -> list[EndpointState]:
    """Eight replicas: 32k-token KV caches at varied usage, queues, adapters."""
    usage = [0.2, 0.55, 0.9, 0.1, 0.97, 0.4, 0.3, 0.75]
    waiting = [0, 3, 1, 0, 6, 2, 0, 1]
    out = []
    for i, address in enumerate(EPS):
        metrics = EndpointMetrics(
            waiting=waiting[i],
            running=4 * i,
            kv_usage=usage[i],
            block_size=BS,
            num_gpu_blocks=2001,
            running_loras=frozenset({"ad"}) if i in (2, 6) else frozenset(),
            max_loras=2,
        )
        out.append(EndpointState(address, "p", i != 7, metrics, NOW - 0.01))
    return out


SYSTEM_A = text("system A", 64 * 60)
SYSTEM_B = text("system B", 64 * 30)
IDS = tuple(range(5000, 5000 + 40 * BS))


def warm_fleet() -> FleetState:
    """Routing memory as after a while of traffic, the same for every run."""
    fleet = FleetState()
    hasher = BlockHasher()
    a = hasher.hashes(InferenceRequest("w", "/v1/completions", "completions", "m", SYSTEM_A))
    b = hasher.hashes(InferenceRequest("w", "/v1/completions", "completions", "m", SYSTEM_B))
    fleet.states.get(approx_prefix()).insert(EPS[1], a, 10_000)
    fleet.states.get(approx_prefix()).insert(EPS[2], a[:20], 10_000)
    fleet.states.get(approx_prefix()).insert(EPS[4], b, 10_000)
    hashes = [hash(("ids", i)) & (2**64 - 1) for i in range(30)]
    fleet.states.get(PRECISE_INDEX).stored(EPS[3], hashes, None, IDS[: 30 * BS], BS)
    fleet.states.get(PRECISE_INDEX).stored(EPS[5], hashes[:10], None, IDS[: 10 * BS], BS)
    fleet.states.get(SESSIONS).bind("s-home", EPS[2], NOW, 300.0)
    fleet.states.get(SESSIONS).bind("s-busy", EPS[4], NOW, 300.0)
    for address, tokens in ((EPS[0], 9000), (EPS[1], 2500), (EPS[3], 600), (EPS[6], 4000)):
        fleet.inflight.add(address, tokens)
    fleet.states.get(PREFILL_BACKLOG).set(EPS[1], 3000.0, NOW - 0.05)
    return fleet


def requests() -> list[InferenceRequest]:
    def req(i: int, prompt: str = "", ids: tuple[int, ...] | None = None, **kw: Any) -> Any:
        return InferenceRequest(f"r{i}", "/v1/completions", "completions", "m", prompt, ids, **kw)

    return [
        req(0, SYSTEM_A + text("q0", 300), max_tokens=200),
        req(1, SYSTEM_A + text("q1", 300), session="s-home"),
        req(2, ids=IDS + (7,) * 40, max_tokens=64),
        req(3, SYSTEM_B + text("q3", 500), session="s-busy", max_tokens=500),
        req(4, text("long", 110_000), max_tokens=100),  # ~27k tokens: the headroom filter acts
        req(5, SYSTEM_A + text("q5", 300), lora="ad"),
        req(6, ids=IDS[: 12 * BS] + (9,) * 100),
        req(7, text("cold", 2000), session="s-new"),
        req(8, SYSTEM_A + text("q0", 300), max_tokens=200),  # request 0 again: now warm
        req(9, SYSTEM_B + text("q9", 100)),
    ]


def decisions(profile: Profile) -> list[tuple[list[str], dict[str, dict[str, float]] | None]]:
    fleet = warm_fleet()
    candidates = snapshot()
    weights = {EPS[0]: 2.0}
    out = []
    for i, request in enumerate(requests()):
        cycle = Cycle(Snapshot(), fleet, weights, now=NOW + 0.01 * i, roles=ROLES)
        decision = profile.run(request, list(candidates), cycle, count=2, explain=True)
        out.append(([e.address for e in decision.endpoints], decision.scores))
    return out


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_shuffled_profiles_decide_and_score_identically(name: str) -> None:
    declared, entries, others = PROFILES[name]
    expected = decisions(built(entries, declared, others))
    scored = [s for _, scores in expected if scores for s in scores.values()]
    assert scored, "no request was scored: the comparison would prove nothing"
    rng = random.Random(name)
    for _ in range(SHUFFLES):
        shuffled = list(entries)
        rng.shuffle(shuffled)
        shuffled_profile = built(shuffled, declared, others)
        assert decisions(shuffled_profile) == expected, [e["plugin"] for e in shuffled]


def test_the_ttft_estimate_reads_cached_tokens_before_or_after_the_prefix_scorer() -> None:
    """The case from the issue: with plugins handing data on in list order, a cold endpoint's
    TTFT score was 0.03 with the prefix scorer listed first and 1.0 with it listed after (the
    estimate then saw no cached tokens anywhere). Now both orders see the warm endpoint."""
    prefix: dict[str, Any] = {"plugin": "prefix-cache-scorer", "weight": 1}
    ttft: dict[str, Any] = {"plugin": "ttft-scorer", "weight": 1}
    picker: dict[str, Any] = {"plugin": "max-score-picker"}
    request = InferenceRequest("r", "/v1/completions", "completions", "m", SYSTEM_A + "?")
    idle = [EndpointState(a, "p", True, EndpointMetrics(), NOW) for a in (EPS[1], EPS[3])]
    results = []
    for entries in ([prefix, ttft, picker], [ttft, prefix, picker]):
        fleet = FleetState()
        fleet.states.get(approx_prefix()).insert(EPS[1], BlockHasher().hashes(request), 10_000)
        decision = built(entries).run(request, idle, Cycle(Snapshot(), fleet, now=NOW), 1, True)
        assert decision.scores is not None
        results.append(decision.scores)
    assert results[0] == results[1]
    warm, cold = results[0][EPS[1]], results[0][EPS[3]]
    assert warm["ttft-scorer"] == 1.0
    assert cold["ttft-scorer"] < 0.1  # 961 uncached prompt tokens against 17


def test_the_plugins_list_of_a_spec_is_a_tuple_of_specs() -> None:
    spec = parse_config(BASE).scheduling.selected
    assert all(isinstance(p, PluginSpec) for p in spec.plugins)
