"""Runs one endpoint source per pool and folds their latest sets into the configuration.

The server calls :meth:`Discovery.configure` with each configuration it applies (start, reload)
and :meth:`Discovery.apply` to get the pools the router should use: every pool's endpoints
replaced by what its source last published. ``on_change`` fires (on the
event loop) whenever a source publishes a different set; the server then re-applies, which
rebuilds the router's candidate lists and tells the scraper. That is where the two guarantees
come from: a departed endpoint leaves the candidate lists in that same call, and a new one
enters the store unready until its first successful scrape, which the ready filter respects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from epp.discovery.eds import EdsFile
from epp.discovery.source import EndpointSource
from epp.discovery.spec import DiscoverySpec, DnsSpec, KubernetesSpec, StaticSpec
from epp.discovery.tasks import cancel_all
from epp.roles import Role


class PoolsConfig(Protocol):
    """What discovery reads of a configuration. :class:`epp.config.Config` satisfies it; it is
    not imported, because the configuration's schema depends on this package's specs."""

    @property
    def pools(self) -> Mapping[str, tuple[str, ...]]: ...

    @property
    def discovery(self) -> Mapping[str, DiscoverySpec]: ...


class PoolsAndRoles(PoolsConfig, Protocol):
    @property
    def roles(self) -> Mapping[str, Role]: ...


log = logging.getLogger(__name__)

# The Envoy cluster every pool's endpoints belong to (epp.envoy_config.POOL_CLUSTER; not
# imported from there, which would make discovery depend on the config renderer).
POOL_CLUSTER = "pool"


def make_source(spec: DiscoverySpec) -> EndpointSource:
    if isinstance(spec, StaticSpec):
        from epp.discovery.static import StaticSource

        return StaticSource(spec)
    if isinstance(spec, DnsSpec):
        from epp.discovery.dns import DnsSource

        return DnsSource(spec)
    if isinstance(spec, KubernetesSpec):
        from epp.discovery.kubernetes import KubernetesSource

        return KubernetesSource(spec)
    raise TypeError(f"no endpoint source for {spec!r}")


def pool_specs(
    config: PoolsConfig, overrides: Mapping[str, DiscoverySpec] | None = None
) -> dict[str, DiscoverySpec]:
    """Each pool's source: an override (``epp serve --pool-name``), its discovery spec, else
    its static endpoint list."""
    overrides = overrides or {}
    return {
        pool: overrides.get(pool) or config.discovery.get(pool) or StaticSpec(addrs)
        for pool, addrs in config.pools.items()
    }


@dataclass(frozen=True, slots=True)
class DiscoveryOptions:
    """What ``epp serve`` flags add to the file's discovery settings."""

    # Pool name -> source replacing the file's (``--pool-name``).
    overrides: Mapping[str, DiscoverySpec] = field(default_factory=dict)
    # Where to write Envoy's EDS file (``--eds-dir``), if Envoy reads it.
    eds_dir: str | None = None


@dataclass
class _Running:
    spec: DiscoverySpec
    task: asyncio.Task[None]
    members: frozenset[str] | None = None
    roles: Mapping[str, Role] = field(default_factory=dict)


class Discovery:
    def __init__(
        self,
        on_change: Callable[[], None],
        options: DiscoveryOptions | None = None,
        make: Callable[[DiscoverySpec], EndpointSource] = make_source,
    ) -> None:
        options = options or DiscoveryOptions()
        self._on_change = on_change
        self._overrides = dict(options.overrides)
        self._make = make
        self._pools: dict[str, _Running] = {}
        self._eds = None if options.eds_dir is None else EdsFile(options.eds_dir, POOL_CLUSTER)

    def configure(self, config: PoolsConfig) -> None:
        """Run the sources ``config`` asks for; a pool whose source is unchanged keeps it
        running (and its membership) across a reload."""
        specs = pool_specs(config, self._overrides)
        for pool in list(self._pools):
            running = self._pools[pool]
            if specs.get(pool) != running.spec:
                running.task.cancel()
                del self._pools[pool]
        for pool, spec in specs.items():
            if pool not in self._pools:
                task = asyncio.create_task(self._follow(pool, spec), name=f"epp-discovery-{pool}")
                self._pools[pool] = _Running(spec, task)

    def apply(self, config: PoolsConfig) -> dict[str, tuple[str, ...]]:
        """``config``'s pools with each pool's endpoints as its source last published them.

        A static pool whose source has not published yet keeps the file's list, so it routes
        from the first request on; a discovered pool is empty until its first answer.
        """
        pools: dict[str, tuple[str, ...]] = {}
        for pool, addrs in config.pools.items():
            running = self._pools.get(pool)
            if running is not None and running.members is not None:
                # Sorted: the candidate order must not depend on set iteration order.
                pools[pool] = tuple(sorted(running.members))
            elif running is None or isinstance(running.spec, StaticSpec):
                pools[pool] = addrs
            else:
                pools[pool] = ()
        return pools

    def roles(self, config: PoolsAndRoles) -> dict[str, Role]:
        """``config``'s endpoint roles with what discovery learned: a DNS pool's ``role`` for
        every address it resolved, a Kubernetes Pod's label for its endpoints."""
        discovered = [r for r in self._pools.values() if not isinstance(r.spec, StaticSpec)]
        # ``config`` may be one this already merged into: a discovered address's role is
        # always the source's latest word, never a departed Pod's.
        learned = {a for r in discovered for a in r.members or ()}
        roles = {a: r for a, r in config.roles.items() if a not in learned}
        for running in discovered:
            if isinstance(running.spec, DnsSpec) and running.spec.role is not None:
                role = running.spec.role
                roles.update((a, role) for a in running.members or ())
            roles.update(running.roles)
        return roles

    def export(self, pools: Mapping[str, tuple[str, ...]]) -> None:
        """Tell Envoy (EDS file, when configured) the endpoints of ``pools``, once every
        source has published: a restarting epp must not shrink the membership Envoy holds
        from its previous run before its own lists complete. With no file yet, the first one
        is written at once: Envoy cannot start without it."""
        if self._eds is None:
            return
        settled = all(r.members is not None for r in self._pools.values())
        if settled or not self._eds.path.exists():
            self._eds.write(pools)

    async def stop(self) -> None:
        tasks = [r.task for r in self._pools.values()]
        self._pools.clear()
        await cancel_all(tasks)

    async def _follow(self, pool: str, spec: DiscoverySpec) -> None:
        def publish(members: frozenset[str], roles: Mapping[str, Role] | None = None) -> None:
            running = self._pools.get(pool)
            # A source replaced by a reload may still publish before its cancellation lands.
            if running is None or running.spec != spec:
                return
            roles = dict(roles or {})
            if running.members == members and running.roles == roles:
                return
            running.members = members
            running.roles = roles
            self._on_change()

        try:
            await self._make(spec).run(publish)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Sources retry their own errors; reaching here is a bug. Keep the last set rather
            # than emptying the pool, and make it loud.
            log.exception("endpoint source of pool %s stopped; keeping its last endpoints", pool)
