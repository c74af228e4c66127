"""The profile builder: execution order from declarations, and the profiles it refuses."""

from __future__ import annotations

from collections.abc import Sequence

from epp.request import InferenceRequest
from epp.scheduling import (
    Cycle,
    DataKey,
    Input,
    Plugin,
    Producer,
    Scorer,
    plugin_class,
    profile_problems,
    register,
)
from epp.scheduling.filters.ready import ReadyEndpointFilter
from epp.scheduling.params import NoParams
from epp.state import EndpointState
from tests.unit.scheduling.common import cycle, ep, profile_of, req

FIRST: DataKey[list[str]] = DataKey("test: what the first producer saw")
SECOND: DataKey[int] = DataKey("test: derived from the first")


@register("test-first-producer")
class FirstProducer(Producer, Scorer):
    produces = (FIRST,)

    def produce(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> None:
        cycle.put(FIRST, [c.address for c in candidates])

    def score(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> list[float]:
        return [0.0] * len(candidates)


@register("test-second-producer")
class SecondProducer(Producer):
    """Reads what the first one wrote: it must run after it, wherever it is listed."""

    produces = (SECOND,)
    consumes = (Input(FIRST),)

    def produce(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> None:
        first = cycle.get(FIRST)
        assert first is not None, "ran before its producer"
        cycle.put(SECOND, len(first))


@register("test-cyclic-producer")
class CyclicProducer(Producer):
    produces = (FIRST,)
    consumes = (Input(SECOND),)

    def produce(
        self, request: InferenceRequest, candidates: Sequence[EndpointState], cycle: Cycle
    ) -> None:
        raise AssertionError("never built")


def entries(
    *types: str, weight: float | None = None
) -> list[tuple[type[Plugin], str, float | None]]:
    """``types`` as profile entries (named by type, scorers weighted) plus the picker."""
    out: list[tuple[type[Plugin], str, float | None]] = []
    for name in (*types, "max-score-picker"):
        cls = plugin_class(name)
        assert cls is not None, name
        out.append((cls, name, weight if issubclass(cls, Scorer) else None))
    return out


def test_producers_run_in_dependency_order_whatever_the_list_order() -> None:
    for order in (
        ["test-second-producer", "test-first-producer"],
        ["test-first-producer", "test-second-producer"],
    ):
        profile = profile_of(*((t, NoParams(), 0.0 if "first" in t else None) for t in order))
        assert [p.name for p in profile.producers] == [
            "test-first-producer",
            "test-second-producer",
        ]
        c = cycle()
        profile.run(req("x"), [ep("a"), ep("b", ready=False)], c, count=1)
        assert c.get(SECOND) == 2  # produced before filters: every candidate


def test_every_profile_gets_the_readiness_filter_first() -> None:
    profile = profile_of(("queue-scorer", NoParams(), 1.0))
    assert isinstance(profile.filters[0], ReadyEndpointFilter)
    picked = {
        profile.run(req("x"), [ep("down", ready=False), ep("up")], cycle(), 1).endpoints[0].address
        for _ in range(20)
    }
    assert picked == {"up"}


def test_a_required_input_without_producer_names_both_plugins() -> None:
    (problem,) = profile_problems(entries("test-second-producer"))
    assert problem.entry == 0
    assert "'test-second-producer'" in problem.message
    assert "'test-first-producer'" in problem.message


def test_optional_inputs_need_no_producer() -> None:
    assert profile_problems(entries("ttft-scorer", "kv-pressure-scorer", weight=1.0)) == []


def test_a_dependency_cycle_and_a_key_produced_twice_are_refused() -> None:
    cyclic = profile_problems(entries("test-cyclic-producer", "test-second-producer"))
    assert [p.message for p in cyclic] == ["must not depend on itself through other producers"]
    twice = profile_problems(entries("test-first-producer", "test-cyclic-producer"))
    assert any(
        "must not produce test: what the first producer saw again" in p.message for p in twice
    )


def test_a_plugin_listed_twice_and_pickers_are_counted() -> None:
    twice = entries("queue-scorer", "queue-scorer", weight=1.0)
    assert [p.message for p in profile_problems(twice)] == [
        "must not list 'queue-scorer' twice (also [0])"
    ]
    producer_twice = [p.message for p in profile_problems(entries("prefix-cache-scorer") * 2)]
    assert "must not list 'prefix-cache-scorer' twice (also [0])" in producer_twice
    no_picker = entries("queue-scorer", weight=1.0)[:1]
    assert [p.message for p in profile_problems(no_picker)] == [
        "must list exactly one picker, found 0"
    ]
