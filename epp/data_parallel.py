"""Data-parallel ranks: one replica, several engines, each scheduled as an endpoint of its own.

A vLLM server started with ``--data-parallel-size N`` runs N engine cores behind one API
server: one address Envoy knows, one ``/metrics`` page whose series carry ``engine="0"`` ..
``engine="N-1"`` (vllm/v1/metrics/loggers.py, ``labelnames = ["model_name", "engine"]``), and
one KV-event publisher per rank at the configured port plus the rank
(``ZmqEventPublisher.offset_endpoint_port``), each batch naming its ``data_parallel_rank``.
Each rank queues, caches and evicts on its own, so a pool that declares ``data_parallel``
gets one endpoint per rank in epp's state: its own queue, KV usage and prefix-cache view.

A rank endpoint is named as llm-d names it, ``host:port+rank`` (rank 0 is the replica's own
address; llm-d's routing sidecar listens on the replica's port plus the rank). The pick still
sends the request to the replica's address; the rank travels in a header, llm-d's
``x-data-parallel-host-port: host:port+rank`` by default or vLLM's own
``x-data-parallel-rank: rank``.

The rank count is declared, not learned from the page: the endpoint set stays what the
configuration says (a replica cannot create endpoints by what it publishes), every rank exists,
unready, before the first scrape, and a rank missing from the page fails its scrapes instead of
silently merging into the others. It is bounded by :data:`MAX_RANKS`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from epp.roles import Role
from epp.wire import DATA_PARALLEL_HOST_PORT, DATA_PARALLEL_RANK

log = logging.getLogger(__name__)

# vLLM's largest single-node DP deployments are 8-16 ranks per API server; 64 leaves room and
# keeps one line of configuration from creating thousands of endpoints.
MAX_RANKS = 64


@dataclass(frozen=True, slots=True)
class DataParallel:
    """A pool's ``data_parallel:`` section."""

    size: int
    header: str = DATA_PARALLEL_HOST_PORT


@dataclass(frozen=True, slots=True)
class Rank:
    """One rank endpoint: the replica Envoy sends to, its index, the header naming it."""

    replica: str
    index: int
    header: str = DATA_PARALLEL_HOST_PORT

    def header_value(self, address: str) -> str:
        """What the answer's header carries for this rank (``address`` is the rank's name)."""
        return str(self.index) if self.header == DATA_PARALLEL_RANK else address


def rank_address(replica: str, index: int) -> str | None:
    """``host:port+index`` (IPv6 hosts keep their brackets); None past port 65535."""
    host, _, port = replica.rpartition(":")
    number = int(port) + index
    return f"{host}:{number}" if number < 65536 else None


def replica_of(ranks: Mapping[str, Rank], endpoint: str) -> str:
    """The address Envoy knows for ``endpoint``: its replica's if it is a rank, else itself."""
    rank = ranks.get(endpoint)
    return endpoint if rank is None else rank.replica


class _Picked(Protocol):
    @property
    def address(self) -> str: ...


def routed(
    ranks: Mapping[str, Rank], endpoints: Sequence[_Picked]
) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The answer's destination list (replicas, each once) and, when the pick is a rank, the
    header naming it."""
    destination = ",".join(dict.fromkeys(replica_of(ranks, e.address) for e in endpoints))
    first = endpoints[0].address if endpoints else ""
    rank = ranks.get(first)
    return destination, () if rank is None else ((rank.header, rank.header_value(first)),)


@dataclass(frozen=True, slots=True)
class Expanded:
    """Pools with each data-parallel replica replaced by its ranks, and what ranks inherit."""

    pools: dict[str, tuple[str, ...]]
    ranks: dict[str, Rank]
    weights: dict[str, float]
    roles: dict[str, Role]
    kv_events: dict[str, str]


def expand(
    pools: Mapping[str, tuple[str, ...]],
    specs: Mapping[str, DataParallel],
    previous: Mapping[str, Rank],
    weights: Mapping[str, float],
    roles: Mapping[str, Role],
    kv_events: Mapping[str, str],
) -> Expanded:
    """Replace each replica of a pool in ``specs`` by its rank endpoints.

    ``pools`` may already hold the ranks of ``previous`` (a pool whose source has not
    published again keeps the list it was given): those are folded back into their replica
    first, so expanding twice gives the same result. A rank whose name is another replica's
    address or another rank's is left out (logged): two endpoints cannot share one name.
    """
    replicas = {
        pool: tuple(a for a in addrs if previous.get(a, Rank(a, 0)).index == 0)
        for pool, addrs in pools.items()
    }
    taken = {a for addrs in replicas.values() for a in addrs}
    used: set[str] = set()
    out = Expanded({}, {}, dict(weights), dict(roles), dict(kv_events))
    for pool, addrs in replicas.items():
        spec = specs.get(pool)
        if spec is None:
            out.pools[pool] = addrs
            continue
        expanded: list[str] = []
        for replica in addrs:
            for index in range(spec.size):
                name = rank_address(replica, index)
                if name is None or name in used or (index > 0 and name in taken):
                    log.warning(
                        "pool %s: rank %d of %s has no free name (%s); it is not scheduled",
                        pool, index, replica, name or "port past 65535",
                    )  # fmt: skip
                    continue
                used.add(name)
                expanded.append(name)
                out.ranks[name] = Rank(replica, index, spec.header)
                _inherit(out, replica, name, index)
        out.pools[pool] = tuple(expanded)
    return out


class RankedConfig(Protocol):
    """What expanding reads of a configuration (:class:`epp.config.Config` has it; not
    imported: the configuration reads this module's sections)."""

    @property
    def pools(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def data_parallel(self) -> Mapping[str, DataParallel]: ...
    @property
    def ranks(self) -> Mapping[str, Rank]: ...
    @property
    def weights(self) -> Mapping[str, float]: ...
    @property
    def roles(self) -> Mapping[str, Role]: ...
    @property
    def kv_events(self) -> Mapping[str, str]: ...


def rank_changes(config: RankedConfig) -> dict[str, Any]:
    """The fields of ``config`` to replace so that each data-parallel replica's endpoints are
    its ranks'; the ranks inherit their replica's weight, role and KV-event publisher (at its
    port plus the rank)."""
    out = expand(
        config.pools,
        config.data_parallel,
        config.ranks,
        config.weights,
        config.roles,
        config.kv_events,
    )
    return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}


def _inherit(out: Expanded, replica: str, name: str, index: int) -> None:
    if replica in out.weights:
        out.weights[name] = out.weights[replica]
    if replica in out.roles:
        out.roles[name] = out.roles[replica]
    events = out.kv_events.get(replica)
    if events is not None:
        out.kv_events[name] = offset_events_address(events, index)


def offset_events_address(address: str, index: int) -> str:
    """vLLM's per-rank KV-event publisher: tcp port plus the rank, ``_dp<rank>`` after an ipc
    path (its ``ZmqEventPublisher.offset_endpoint_port``)."""
    if index == 0:
        return address
    if address.startswith("tcp://"):
        base, _, port = address.rpartition(":")
        if port.isdigit():
            return f"{base}:{int(port) + index}"
    return f"{address}_dp{index}"
