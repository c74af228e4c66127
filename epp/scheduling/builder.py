"""From a profile's plain specification to a runnable :class:`~epp.scheduling.Profile`.

The configuration holds plain data (:class:`PluginSpec`, :class:`ProfileSpec`); the router
builds plugin instances from it with :func:`build_profile` on every configuration swap. What a
profile's plugins declare decides the execution order, never the order the file lists them in:

- producers run first, each after the producers of what it consumes (ties by name);
- filters run readiness first, then by their ``stage``, then by name; every profile gets the
  ``ready-endpoint-filter`` and the ``health-filter`` (added when not listed): an unready or
  ejected endpoint never serves (but for half-open trials, see :mod:`epp.state.health`);
- scorers are summed by name, so even floating-point totals are the same for any list order;
- post-pick and prepare hooks run by name.

:func:`profile_problems` checks a profile from the plugin classes alone (the configuration
validator calls it for every profile, selected or not): exactly one picker, weights only on
scorers and never negative, no plugin listed twice, no data produced twice, and every required
input with a producer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.scheduling.data import DataKey, Derived, derived_from, derived_rules
from epp.scheduling.filters.health import HealthFilter
from epp.scheduling.filters.ready import ReadyEndpointFilter
from epp.scheduling.framework import (
    Decider,
    DeciderParams,
    Filter,
    Picker,
    Plugin,
    PostPick,
    Prepare,
    Producer,
    Profile,
    Scorer,
    create_plugin,
    producers_of,
)
from epp.scheduling.params import Params

READY_FILTER = ReadyEndpointFilter.type_name
HEALTH_FILTER = HealthFilter.type_name


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """One profile entry: a registered plugin type, its name in the profile, its validated
    parameters and, for scorers, its weight (None when the file gives none)."""

    type_name: str
    name: str
    params: Params
    weight: float | None = None


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    name: str
    plugins: tuple[PluginSpec, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    """A profile error: ``entry`` is the list index (None: the profile as a whole), ``key`` a
    key inside that entry (``weight``), ``message`` starts with "must"."""

    entry: int | None
    key: str | None
    message: str


def _kind(cls: type[Plugin]) -> str:
    if issubclass(cls, Scorer):
        return "scorer"
    if issubclass(cls, Filter):
        return "filter"
    if issubclass(cls, Picker):
        return "picker"
    if issubclass(cls, Decider):
        return "decider"
    return "producer"


def profile_problems(entries: Sequence[tuple[type[Plugin], str, float | None]]) -> list[Problem]:
    """Everything wrong with a profile of ``(plugin class, name, weight)`` entries."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    produced: dict[DataKey[Any], tuple[int, str]] = {}
    for i, (cls, name, weight) in enumerate(entries):
        if name in seen:
            problems.append(Problem(i, None, f"must not list '{name}' twice (also [{seen[name]}])"))
        seen.setdefault(name, i)
        if weight is not None and not issubclass(cls, Scorer):
            problems.append(
                Problem(
                    i,
                    "weight",
                    f"must not be set: '{name}' is a {_kind(cls)}, only scorers are weighted",
                )
            )
        elif weight is not None and weight < 0:
            problems.append(Problem(i, "weight", f"must be a number >= 0, got {weight:g}"))
        for key in cls.produces:
            if key in produced:
                first, other = produced[key]
                problems.append(
                    Problem(
                        i,
                        None,
                        f"must not produce {key.description} again ('{other}' [{first}] does)",
                    )
                )
            produced.setdefault(key, (i, name))
    pickers = sum(1 for cls, _, _ in entries if issubclass(cls, Picker))
    if pickers != 1:
        problems.append(Problem(None, None, f"must list exactly one picker, found {pickers}"))
    deciders = sum(1 for cls, _, _ in entries if issubclass(cls, Decider))
    if deciders > 1:
        problems.append(Problem(None, None, f"must list at most one decider, found {deciders}"))
    for i, (cls, name, _) in enumerate(entries):
        for need in cls.consumes:
            if need.required and not _available(need.key, produced):
                problems.append(Problem(i, None, _missing(cls, name, need.key)))
    makers = {name: cls for cls, name, _ in entries if issubclass(cls, Producer)}
    try:
        _dependency_order(sorted(makers.items(), key=lambda item: item[0]))
    except ValueError as exc:
        at = seen[str(exc)]
        problems.append(Problem(at, None, "must not depend on itself through other producers"))
    return problems


def _sources(key: DataKey[Any]) -> tuple[DataKey[Any], ...]:
    rule = derived_from(key)
    return rule.sources if rule is not None else (key,)


def _available(key: DataKey[Any], produced: Mapping[DataKey[Any], object]) -> bool:
    return any(source in produced for source in _sources(key))


def _missing(cls: type[Plugin], name: str, key: DataKey[Any]) -> str:
    makers = sorted({p for source in _sources(key) for p in producers_of(source)})
    listed = " or ".join(f"'{m}'" for m in makers) or "a producer (none is registered)"
    return (
        f"must come with a producer of {key.description}: {_kind(cls)} '{name}' "
        f"({cls.type_name}) needs it; add {listed} to the profile (weight 0 to only produce)"
    )


def build_profile(spec: ProfileSpec) -> Profile:
    """Plugin instances for ``spec`` in execution order. ``spec`` must be valid
    (:func:`profile_problems` returned nothing for it): the configuration checked it."""
    plugins: list[Plugin] = [create_plugin(p.type_name, p.name, p.params) for p in spec.plugins]
    weights = {p.name: 1.0 if p.weight is None else p.weight for p in spec.plugins}
    for implicit, cls in ((READY_FILTER, ReadyEndpointFilter), (HEALTH_FILTER, HealthFilter)):
        if not any(isinstance(p, cls) for p in plugins):
            plugins.append(create_plugin(implicit, implicit))
    by_name = sorted(plugins, key=lambda p: p.name)
    makers = {p.name: p for p in by_name if isinstance(p, Producer)}
    order = _dependency_order([(name, type(p)) for name, p in makers.items()])
    producers = [makers[name] for name in order]
    produced = {key for p in producers for key in p.produces}
    derived: list[Derived[Any]] = [
        rule for rule in derived_rules() if any(s in produced for s in rule.sources)
    ]
    filters = sorted((p for p in plugins if isinstance(p, Filter)), key=lambda f: (f.stage, f.name))
    (picker,) = [p for p in by_name if isinstance(p, Picker)]
    decider = next((p for p in by_name if isinstance(p, Decider)), None)
    return Profile(
        name=spec.name,
        filters=filters,
        scorers=[(p, weights[p.name]) for p in by_name if isinstance(p, Scorer)],
        picker=picker,
        post_pick=[p for p in by_name if isinstance(p, PostPick)],
        prepare=[p for p in by_name if isinstance(p, Prepare)],
        producers=producers,
        derived=derived,
        decider=decider,
    )


def decider_problems(profiles: Mapping[str, ProfileSpec]) -> list[tuple[str, str]]:
    """``(profile, message)`` for every decider whose prefill profile is missing,
    itself, or disaggregates again (a prefill leg is never split once more)."""
    problems = []
    for name, spec in profiles.items():
        for entry in spec.plugins:
            if not isinstance(entry.params, DeciderParams):
                continue
            target = entry.params.prefill_profile
            other = profiles.get(target)
            if other is None or target == name:
                what = "this profile" if target == name else "no profile"
                problems.append(
                    (
                        name,
                        f"{entry.name}: prefill_profile must name another profile, got "
                        f"{target!r} ({what}; profiles: {', '.join(profiles)})",
                    )
                )
            elif any(isinstance(p.params, DeciderParams) for p in other.plugins):
                problems.append(
                    (name, f"{entry.name}: prefill_profile {target!r} must not have a decider")
                )
    return problems


def _dependency_order(producers: Sequence[tuple[str, type[Plugin]]]) -> list[str]:
    """Names of ``producers`` ordered so that each runs after the producers of what it
    consumes; ``ValueError`` names a plugin of a dependency cycle."""
    makers = {key: name for name, cls in producers for key in cls.produces}
    classes = dict(producers)
    ordered: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in ordered:
            return
        if name in visiting:
            raise ValueError(name)
        visiting.add(name)
        for need in classes[name].consumes:
            for source in _sources(need.key):
                maker = makers.get(source)
                if maker is not None and maker != name:
                    visit(maker)
        visiting.discard(name)
        ordered.append(name)

    for name, _ in producers:
        visit(name)
    return ordered
