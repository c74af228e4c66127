"""Scheduling: a profile of filters, weighted scorers and a picker, chosen per request."""

from epp.scheduling import filters, pickers, scorers
from epp.scheduling.framework import (
    Cycle,
    Decision,
    Filter,
    Picker,
    Plugin,
    PostPick,
    Prepare,
    Profile,
    Scorer,
    create_plugin,
    plugin_types,
    register,
)

__all__ = [
    "Cycle",
    "Decision",
    "Filter",
    "Picker",
    "Plugin",
    "PostPick",
    "Prepare",
    "Profile",
    "Scorer",
    "create_plugin",
    "filters",
    "pickers",
    "plugin_types",
    "register",
    "scorers",
]
