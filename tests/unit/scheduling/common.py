"""Builders shared by the scheduling plugin tests."""

from __future__ import annotations

from typing import Any

from epp.request import InferenceRequest
from epp.scheduling import Cycle
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
