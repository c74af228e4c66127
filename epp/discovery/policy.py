"""What the cluster's resources add to the configuration (epp.discovery.pool_resources): kept
apart from the watcher so that reading it costs no Kubernetes client import."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from epp.rewrite import Rule


@dataclass(frozen=True, slots=True)
class ClusterPolicy:
    """What the cluster's resources say about requests: rewrite rules in precedence order and
    objective priorities, with why some resources could not be used (empty when no pool
    follows Kubernetes)."""

    rewrites: tuple[Rule, ...] = ()
    objectives: Mapping[str, int] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
