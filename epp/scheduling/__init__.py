"""Scheduling: a profile of producers, filters, weighted scorers and a picker, per request."""

from epp.scheduling import deciders, filters, pickers, scorers
from epp.scheduling.builder import (
    PluginSpec,
    ProfileSpec,
    build_profile,
    decider_problems,
    profile_problems,
)
from epp.scheduling.data import DataKey, Input
from epp.scheduling.framework import (
    Cycle,
    Decider,
    Decision,
    Filter,
    Picker,
    Plugin,
    PostPick,
    Prepare,
    Producer,
    Profile,
    Scorer,
    create_plugin,
    plugin_class,
    plugin_types,
    register,
)

__all__ = [
    "Cycle",
    "DataKey",
    "Decider",
    "Decision",
    "Filter",
    "Input",
    "Picker",
    "Plugin",
    "PluginSpec",
    "PostPick",
    "Prepare",
    "Producer",
    "Profile",
    "ProfileSpec",
    "Scorer",
    "build_profile",
    "create_plugin",
    "decider_problems",
    "deciders",
    "filters",
    "pickers",
    "plugin_class",
    "plugin_types",
    "profile_problems",
    "register",
    "scorers",
]
