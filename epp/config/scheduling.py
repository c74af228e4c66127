"""The ``scheduling`` section: named plugin instances and profiles (docs/scheduling.md).
Every profile is checked, selected or not; a :class:`SchedulingConfig` holds specifications,
and the router builds the selected profile's plugins from them (:mod:`epp.scheduling.builder`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from epp.config.schema import knob, section
from epp.config.walker import Node, deferred
from epp.scheduling import (
    PluginSpec,
    ProfileSpec,
    decider_problems,
    plugin_class,
    plugin_types,
    profile_problems,
)
from epp.scheduling.params import parse_params

# The profile used when the file names none. Cache affinity and load meet in one unit in the
# TTFT estimate; load is counted at pick time so bursts cannot herd between scrapes; filters keep
# LoRA requests where the adapter can run and long prompts where they fit. Chosen by
# benchmarks/routing.py (docs/benchmarks.md); GIE's 3:2:2 profile is in benchmarks/profiles.
DEFAULT_PROFILE: list[dict[str, Any]] = [
    {"plugin": "ready-endpoint-filter"},
    {"plugin": "lora-filter"},
    {"plugin": "kv-headroom-filter"},
    {"plugin": "prefix-cache-scorer", "weight": 3},
    {"plugin": "session-affinity-scorer", "weight": 3},
    {"plugin": "lora-affinity-scorer", "weight": 1},
    {"plugin": "inflight-load-scorer", "weight": 3},
    {"plugin": "ttft-scorer", "weight": 4},
    {"plugin": "max-score-picker"},
]


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Every profile of the file (plus the built-in ``default`` unless the file defines one)
    and the one in use."""

    profile: str = "default"
    profiles: Mapping[str, ProfileSpec] = field(default_factory=dict)

    @property
    def selected(self) -> ProfileSpec:
        return self.profiles[self.profile]


@section("the plugins that pick an endpoint, in named profiles (docs/scheduling.md)")
@dataclass(frozen=True, slots=True)
class SchedulingSection:
    profile: str = knob("default", doc="the profile in use")
    plugins: Any = knob(
        None,
        read=deferred,
        shape="[{name, type, parameters}]",
        doc="named plugin instances with parameters, checked even when no profile uses them",
    )
    profiles: Any = knob(
        None,
        read=deferred,
        shape="{NAME: [{plugin, weight, parameters}]}",
        doc="profile name -> its plugins; the built-in default unless the file defines one",
    )


def build_scheduling(scheduling: SchedulingSection, node: Node) -> SchedulingConfig:
    """The section read at ``node``, every profile checked against the declared plugins."""
    declared = _declared_plugins(node.child("plugins"))
    profiles: dict[str, ProfileSpec] = {}
    listed = node.child("profiles")
    for name, entries in listed.items():
        profiles[name] = _profile(name, entries, declared)
    if "default" not in profiles:
        builtin = Node(DEFAULT_PROFILE, f"{listed.path}.default", node.source, node.errors)
        profiles["default"] = _profile("default", builtin, declared)
    for name, message in decider_problems(profiles):
        listed.at(name).report(message)
    wanted = scheduling.profile
    if wanted not in profiles:
        node.at("profile").report(
            f"must name a profile under scheduling.profiles, got {wanted!r} "
            f"(profiles: {', '.join(profiles)})"
        )
        wanted = "default"
    return SchedulingConfig(wanted, profiles)


def _declared_plugins(node: Node) -> dict[str, PluginSpec | None]:
    """``scheduling.plugins``: named plugin instances with parameters, checked even when no
    profile uses them (None: declared, but already reported as bad)."""
    declared: dict[str, PluginSpec | None] = {}
    for item in node.list():
        item.only("name", "type", "parameters")
        type_name = item.get("type", str, "")
        if not type_name:
            item.at("type").report("must be set to a plugin type")
            continue
        name = item.get("name", str, type_name)
        if name in declared:
            item.at("name").report(f"must be unique, got {name!r} twice")
        declared[name] = _plugin_spec(type_name, name, item.child("parameters"), item.at("type"))
    return declared


def _plugin_spec(type_name: str, name: str, params: Node, where: Node) -> PluginSpec | None:
    cls = plugin_class(type_name)
    if cls is None:
        where.report(
            f"must be a plugin type, got {type_name!r} (types: {', '.join(plugin_types())})"
        )
        return None
    values, problems = parse_params(cls.params_type, params.mapping())
    for key, message in problems:
        params.at(key).report(message)
    if values is None:
        return None
    return PluginSpec(type_name, name, values)


def _profile(name: str, node: Node, declared: Mapping[str, PluginSpec | None]) -> ProfileSpec:
    specs: list[PluginSpec] = []
    positions: list[int] = []
    if node.value is not None and not isinstance(node.value, list):
        node.list()  # reports the wrong type; nothing else to check
        return ProfileSpec(name, ())
    entries = node.list()
    for i, entry in enumerate(entries):
        entry.only("plugin", "pluginRef", "weight", "parameters")
        ref = entry.get("plugin", str, "") or entry.get("pluginRef", str, "")
        if not ref:
            entry.at("plugin").report("must name a plugin")
            continue
        weight = entry.optional_real("weight")
        parameters = entry.child("parameters")
        if ref in declared:
            spec = declared[ref]
            if parameters.value is not None:
                parameters.report(f"must be given under scheduling.plugins, where '{ref}' is")
        else:
            spec = _plugin_spec(ref, ref, parameters, entry.at("plugin"))
        if spec is None:
            continue
        specs.append(PluginSpec(spec.type_name, spec.name, spec.params, weight))
        positions.append(i)
    complete = len(specs) == len(entries)
    classes = [(plugin_class(s.type_name), s.name, s.weight) for s in specs]
    for problem in profile_problems([(c, n, w) for c, n, w in classes if c is not None]):
        # With an entry already reported, what the profile lacks (a picker, a producer) may be
        # that entry: only the other entries' own problems are worth reporting.
        if complete or problem.key is not None:
            at = node if problem.entry is None else entries[positions[problem.entry]]
            (at.at(problem.key) if problem.key else at).report(problem.message)
    return ProfileSpec(name, tuple(specs))
