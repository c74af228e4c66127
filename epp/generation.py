"""What one configuration decides about a request, built once per configuration swap.

A stream captures the generation current when it opens and keeps it to its end: its headers,
its body, its admission (however long flow control holds it) and its pick all read one
configuration, so a reload never splits a request between two (docs/architecture.md). Which
endpoints exist is not part of it: discovery changes membership under running streams, and a
held request must not be released onto a replica that has left.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from epp.config import Config
from epp.request import LatencyTarget
from epp.scheduling import Profile, build_profile


@runtime_checkable
class DefaultTarget(Protocol):
    """A plugin that gives requests without a target one (the latency-target filter)."""

    default_target: LatencyTarget


@dataclass(frozen=True, slots=True)
class Generation:
    """One configuration and what is derived from it for requests: the selected profile's
    plugins and the latency target of each objective."""

    config: Config
    profile: Profile
    # The profile that picks prefill replicas, when the profile's decider disaggregates.
    prefill: Profile | None
    # Whether requests are awaited (Router.prepare, Router.admit) before they are routed.
    needs_preparation: bool
    # The profile's default target, merged with each objective's ('' for no objective).
    default_target: LatencyTarget
    objective_targets: Mapping[str, LatencyTarget | None]

    @classmethod
    def build(cls, config: Config) -> Generation:
        profile = build_profile(config.scheduling.selected)
        default = next(
            (f.default_target for f in profile.filters if isinstance(f, DefaultTarget)),
            LatencyTarget(),
        )
        decider = profile.decider
        prefill = None
        if decider is not None:
            prefill = build_profile(config.scheduling.profiles[decider.prefill_profile])
        return cls(
            config=config,
            profile=profile,
            prefill=prefill,
            needs_preparation=bool(profile.prepare)
            or config.flow_control.mode == "queue"
            or config.budgets.enabled,
            default_target=default,
            objective_targets={
                name: merged(default, config.request.objective_targets.get(name))
                for name in ("", *config.request.objective_targets)
            },
        )


def merged(
    default: LatencyTarget,
    objective: LatencyTarget | None,
    ttft: float | None = None,
    tpot: float | None = None,
) -> LatencyTarget | None:
    """Each kind from the first that sets it: the headers' ``ttft``/``tpot``, the objective's,
    the profile default's; None when none sets any."""
    objective = objective or LatencyTarget()
    target = LatencyTarget(
        _first(ttft, objective.ttft, default.ttft), _first(tpot, objective.tpot, default.tpot)
    )
    return target if target else None


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)
