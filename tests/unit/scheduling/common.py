"""Builders shared by the scheduling plugin tests."""

from __future__ import annotations

from typing import Any

from epp.request import InferenceRequest
from epp.scheduling import (
    Cycle,
    PluginSpec,
    Producer,
    Profile,
    ProfileSpec,
    Scorer,
    build_profile,
)
from epp.scheduling.params import Params
from epp.scheduling.pickers.max_score import MaxScoreParams
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState


def ep(address: str, ready: bool = True, **metrics: Any) -> EndpointState:
    return EndpointState(address, "pool", ready, EndpointMetrics(**metrics), 1.0)


def req(
    prompt: str = "",
    model: str = "m",
    tokens: tuple[int, ...] | None = None,
    **fields: Any,
) -> InferenceRequest:
    return InferenceRequest(
        "id", "/v1/completions", "completions", model, prompt, prompt_token_ids=tokens, **fields
    )


def cycle(fleet: FleetState | None = None, now: float = 1000.0, **kwargs: Any) -> Cycle:
    """A fresh per-request cycle over ``fleet`` (shared across requests like the server's)."""
    return Cycle(Snapshot(), fleet if fleet is not None else FleetState(), now=now, **kwargs)


def text(seed: str, chars: int) -> str:
    """Deterministic text of exactly ``chars`` characters that differs per ``seed``."""
    unit = f"{seed}:" + "".join(chr(97 + (i * 7 + len(seed)) % 26) for i in range(57))
    return (unit * (chars // len(unit) + 1))[:chars]


def scored(
    plugin: Scorer, request: InferenceRequest, candidates: list[EndpointState], cycle: Cycle
) -> list[float]:
    """``plugin``'s scores as a profile computes them: its data step first if it has one."""
    if isinstance(plugin, Producer):
        plugin.produce(request, candidates, cycle)
    return list(plugin.score(request, candidates, cycle))


def profile_of(*entries: tuple[str, Params, float | None], seed: int = 1) -> Profile:
    """A built profile of ``(plugin type, parameters, weight)`` entries, named by type, with a
    seeded max-score picker."""
    specs = [PluginSpec(kind, kind, params, weight) for kind, params, weight in entries]
    specs.append(PluginSpec("max-score-picker", "max-score-picker", MaxScoreParams(seed=seed)))
    return build_profile(ProfileSpec("test", tuple(specs)))
