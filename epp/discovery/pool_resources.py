"""What the cluster says about a pool's requests besides its endpoints: the
``InferenceModelRewrite`` and ``InferenceObjective`` resources whose ``spec.poolRef`` names the
InferencePool a pool follows (docs/rewrite.md, docs/kubernetes.md).

Each kind is followed in both API groups (``llm-d.ai/v1alpha2`` and, read-only for clusters
migrating from it, ``inference.networking.x-k8s.io/v1alpha2``) with the list-then-watch of
:mod:`epp.discovery.kubernetes`; a group whose CRD is not installed is simply empty. Every
change publishes the pool's whole :class:`ClusterPolicy`, never a delta; the router builds a
new generation from it (epp.generation). epp only reads: it writes no status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from lightkube.generic_resource import create_namespaced_resource

from epp.discovery.kubernetes import connect, list_watch
from epp.discovery.policy import ClusterPolicy
from epp.discovery.spec import KubernetesSpec
from epp.discovery.tasks import cancel_all
from epp.rewrite import Rule
from epp.rewrite.kubernetes import GROUPS, VERSION, Resource, oldest_first, rewrite_rules

log = logging.getLogger(__name__)

REWRITE_KINDS = tuple(
    (
        group,
        create_namespaced_resource(
            group, VERSION, "InferenceModelRewrite", "inferencemodelrewrites"
        ),
    )
    for group in GROUPS
)
OBJECTIVE_KINDS = tuple(
    (group, create_namespaced_resource(group, VERSION, "InferenceObjective", "inferenceobjectives"))
    for group in GROUPS
)


def objective_priorities(resources: list[Resource], pool: str) -> tuple[dict[str, int], list[str]]:
    """Objective name -> priority of the InferenceObjectives for ``pool`` (an unset priority is
    0, as llm-d reads it); when both groups name one objective, the current group's wins."""
    priorities: dict[str, int] = {}
    problems: list[str] = []
    # Oldest first, so the newer of two same-named objectives (the other group's) is kept...
    for resource in oldest_first(r for r in resources if r.for_pool(pool)):
        priority = resource.spec.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            problems.append(f"InferenceObjective {resource.label}: priority must be an integer")
            continue
        if resource.name in priorities and resource.group != GROUPS[0]:
            continue  # ...unless the kept one is of the current group
        priorities[resource.name] = priority
    return priorities, problems


def as_resource(group: str, obj: Any) -> Resource:
    """A lightkube object as the adapters read it."""
    meta = obj.metadata
    created = meta.creationTimestamp
    if isinstance(created, datetime):
        created = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    spec = obj.get("spec") if hasattr(obj, "get") else None
    return Resource(
        group,
        meta.namespace or "",
        meta.name or "",
        created or "",
        spec if isinstance(spec, Mapping) else {},
    )


class PoolResourceSource:
    """Follows the rewrite and objective resources of one InferencePool until cancelled."""

    def __init__(self, spec: KubernetesSpec) -> None:
        self._spec = spec

    async def run(self, publish: Callable[[ClusterPolicy], None]) -> None:
        client = await connect(self._spec)
        seen: dict[tuple[str, str], list[Resource]] = {}

        def changed() -> None:
            pool = self._spec.pool_name
            rewrites = [r for (kind, _), rs in seen.items() if kind == "rewrite" for r in rs]
            objectives = [r for (kind, _), rs in seen.items() if kind == "objective" for r in rs]
            rules, problems = rewrite_rules(rewrites, pool)
            priorities, more = objective_priorities(objectives, pool)
            publish(ClusterPolicy(tuple(rules), priorities, tuple(problems + more)))

        async def follow(what: str, group: str, kind: Any) -> None:
            async for objects in list_watch(client, kind, self._spec.namespace):
                seen[(what, group)] = [as_resource(group, o) for o in objects.values()]
                changed()

        kinds = [("rewrite", g, k) for g, k in REWRITE_KINDS]
        kinds += [("objective", g, k) for g, k in OBJECTIVE_KINDS]
        try:
            await asyncio.gather(*(follow(*k) for k in kinds))
        finally:
            await client.close()


class ClusterResources:
    """Runs one :class:`PoolResourceSource` per pool that follows an InferencePool, and merges
    what they publish; ``on_change`` fires (on the event loop) when that changes."""

    def __init__(
        self,
        on_change: Callable[[], None],
        make: Callable[[KubernetesSpec], PoolResourceSource] = PoolResourceSource,
    ) -> None:
        self._on_change = on_change
        self._make = make
        self._running: dict[str, tuple[KubernetesSpec, asyncio.Task[None]]] = {}
        self._latest: dict[str, ClusterPolicy] = {}

    def configure(self, specs: Mapping[str, KubernetesSpec]) -> None:
        """Follow the resources of the InferencePools ``specs`` (pool -> its spec) name."""
        for pool in list(self._running):
            spec, task = self._running[pool]
            if specs.get(pool) != spec:
                task.cancel()
                del self._running[pool]
                if self._latest.pop(pool, None) is not None:
                    self._on_change()
        for pool, spec in specs.items():
            if pool not in self._running:
                task = asyncio.create_task(self._follow(pool, spec), name=f"epp-resources-{pool}")
                self._running[pool] = (spec, task)

    def current(self) -> ClusterPolicy:
        """Every pool's rules (pools in name order) and objectives merged (on a name given by
        two pools, the first pool's priority)."""
        rules: list[Rule] = []
        objectives: dict[str, int] = {}
        problems: list[str] = []
        for pool in sorted(self._latest):
            latest = self._latest[pool]
            rules += latest.rewrites
            for name, priority in latest.objectives.items():
                objectives.setdefault(name, priority)
            problems += latest.problems
        return ClusterPolicy(tuple(rules), objectives, tuple(problems))

    async def stop(self) -> None:
        tasks = [task for _, task in self._running.values()]
        self._running.clear()
        await cancel_all(tasks)

    async def _follow(self, pool: str, spec: KubernetesSpec) -> None:
        def publish(resources: ClusterPolicy) -> None:
            running = self._running.get(pool)
            if running is None or running[0] != spec or self._latest.get(pool) == resources:
                return
            self._latest[pool] = resources
            self._on_change()

        try:
            await self._make(spec).run(publish)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("resource watch of pool %s stopped; keeping what it last saw", pool)
