"""What one configuration decides about a request, built once per configuration swap.

A stream captures the generation current when it opens and keeps it to its end: its headers,
its body, its admission (however long flow control holds it) and its pick all read one
configuration, so a reload never splits a request between two (docs/architecture.md). Which
endpoints exist is not part of it: discovery changes membership under running streams, and a
held request must not be released onto a replica that has left. What the cluster says
(``InferenceModelRewrite`` and ``InferenceObjective`` resources, :class:`ClusterPolicy`) is:
a change there builds a new generation, like a reload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from epp.config import Config
from epp.discovery.policy import ClusterPolicy
from epp.request import LatencyTarget
from epp.rewrite import AcceptedModels, RewriteTable, Rule
from epp.rewrite.rules import usable
from epp.scheduling import Profile, build_profile


@runtime_checkable
class DefaultTarget(Protocol):
    """A plugin that gives requests without a target one (the latency-target filter)."""

    default_target: LatencyTarget


@dataclass(frozen=True, slots=True)
class Generation:
    """One configuration and what is derived from it for requests: the selected profile's
    plugins, the latency target of each objective and the model rewrites. ``config`` holds the
    cluster's objectives merged into the file's."""

    config: Config
    profile: Profile
    # The profile that picks prefill replicas, when the profile's decider disaggregates.
    prefill: Profile | None
    # Whether requests are awaited (Router.prepare, Router.admit) before they are routed.
    needs_preparation: bool
    # The profile's default target, merged with each objective's ('' for no objective).
    default_target: LatencyTarget
    objective_targets: Mapping[str, LatencyTarget | None]
    rewrites: RewriteTable
    # The model names a request may send (configured ones and those rules rewrite).
    models: AcceptedModels
    # Why some of the cluster's rules or objectives are not used as they are (for a log line).
    problems: tuple[str, ...]

    @classmethod
    def build(cls, config: Config, cluster: ClusterPolicy | None = None) -> Generation:
        cluster = cluster or ClusterPolicy()
        problems = list(cluster.problems)
        if cluster.objectives:
            file = config.request.objectives
            problems += [
                f"objective {name!r}: priority {priority} from the cluster overrides "
                f"{file[name]} from the file"
                for name, priority in cluster.objectives.items()
                if name in file and file[name] != priority
            ]
            objectives = {**file, **cluster.objectives}
            config = replace(config, request=replace(config.request, objectives=objectives))
        rewrites, dropped = _rewrites(config, cluster)
        problems += dropped
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
            rewrites=rewrites,
            models=AcceptedModels(config.models, rewrites),
            problems=tuple(problems),
        )


def _rewrites(config: Config, cluster: ClusterPolicy) -> tuple[RewriteTable, list[str]]:
    """The file's rules and the cluster's in precedence order: the cluster's exact rules
    before the file's (the cluster wins, as for objectives), match-all rules after both;
    targets epp cannot route left out."""
    served = {name for name, spec in config.models.items() if spec.pools}
    cluster_rules, problems = usable(cluster.rewrites, served)
    named = RewriteTable(cluster_rules).names
    file_rules = []
    for name, spec in config.models.items():
        if not spec.rewrite:
            continue
        if name in named:
            problems.append(f"models.{name}.rewrite: replaced by a rule from the cluster")
        origin = f"models.{name}.rewrite"
        file_rules.append(Rule((name,), spec.rewrite, origin, spec.rewrite_sticky))
    ordered = [r for r in cluster_rules if r.models] + file_rules
    ordered += [r for r in cluster_rules if not r.models]
    return RewriteTable(ordered), problems


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
