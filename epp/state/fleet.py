"""Long-lived routing state that outlives any one configuration: the scheduler's memory.

Plugins are rebuilt on every configuration reload; what they learn (in-flight work, prefix
indexes, sessions, the TTFT scorer's prefill backlog, endpoint health, each endpoint's learned
speed) must not be lost with them, so it lives here, owned by the server and reached by plugins
through the scheduling :class:`~epp.scheduling.Cycle`. The fields are the core's own tables;
a plugin's state is declared with a :class:`~epp.state.registry.StateKey` and kept in
:attr:`FleetState.states` (the approximate prefix index is one, keyed by its hashing
parameters: :func:`approx_prefix`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from epp.prefix.approximate import ApproximatePrefixIndex, Insertion
from epp.prefix.hashing import BlockHasher
from epp.prefix.precise import PreciseIndex
from epp.prefix.tokens import TokenizerRegistry
from epp.state.backlog import PrefillBacklog
from epp.state.cold_picks import ColdPicks
from epp.state.group_queues import GroupQueues
from epp.state.health import HealthTracker
from epp.state.inflight import InflightTracker
from epp.state.latency import LatencyModel
from epp.state.memory import MemoryStore
from epp.state.registry import Replication, StateKey, States
from epp.state.sessions import SessionTable
from epp.state.store import StateStore

# The approximate prefix index's state name (one instance per hashing parameter set).
APPROX_PREFIX = "approx-prefix"
_DEFAULT_HASHER = BlockHasher()


@functools.cache
def approx_prefix(hasher: BlockHasher = _DEFAULT_HASHER) -> StateKey[ApproximatePrefixIndex]:
    """The approximate prefix index of prompts cut by ``hasher``.

    Keyed by what changes a block hash's meaning (``block_chars``, ``block_size``; the model and
    adapter are in the hash itself, ``max_blocks`` only cuts the chain short). The default
    parameters keep the pick-stream tag ``prefix`` of the releases before keyed indexes, so a
    rolling upgrade of a group configured with them still shares its index.
    """
    params = (hasher.block_chars, hasher.block_size)
    default = (_DEFAULT_HASHER.block_chars, _DEFAULT_HASHER.block_size)
    return StateKey(
        APPROX_PREFIX,
        ApproximatePrefixIndex,
        params,
        moves=True,
        replicated=Replication(Insertion),
        tag="prefix" if params == default else "",
    )


@dataclass
class FleetState:
    store: StateStore = field(default_factory=MemoryStore)
    inflight: InflightTracker = field(default_factory=InflightTracker)
    sessions: SessionTable = field(default_factory=SessionTable)
    # Engine-reported prefix caches (KV events) and the tokenizers that key prompts like them.
    precise: PreciseIndex = field(default_factory=PreciseIndex)
    tokenizers: TokenizerRegistry = field(default_factory=TokenizerRegistry)
    # Prefill tokens queued per endpoint by epp's own picks (the TTFT scorer's fluid model).
    prefill: PrefillBacklog = field(default_factory=PrefillBacklog)
    # Which endpoint most recently received a prompt cached nowhere (the no-hit-LRU scorer).
    cold_picks: ColdPicks = field(default_factory=ColdPicks)
    # Each endpoint's circuit, judged from the responses it served (passive health).
    health: HealthTracker = field(default_factory=HealthTracker)
    # Each endpoint's learned prefill rate, queueing and decode speed (the latency model).
    latency: LatencyModel = field(default_factory=LatencyModel)
    # Flow control's ledger and the other epp processes' queues (cluster-wide bands, fairness).
    queues: GroupQueues = field(default_factory=GroupQueues)
    # Plugins' own long-lived states (epp.state.registry), one instance per key.
    states: States = field(default_factory=States)

    @property
    def prefix(self) -> ApproximatePrefixIndex:
        """The approximate prefix index of the default hashing parameters."""
        return self.states.get(approx_prefix())
