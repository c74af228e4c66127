"""Long-lived routing state that outlives any one configuration: the scheduler's memory.

Plugins are rebuilt on every configuration reload; what they learn must not be lost with them,
so it lives here, owned by the server and reached by plugins through the scheduling
:class:`~epp.scheduling.Cycle`.

A state one plugin keeps (a prefix index, the session table, the TTFT scorer's prefill backlog,
the no-hit-LRU scorer's cold picks) is declared by that plugin with a
:class:`~epp.state.registry.StateKey` and kept in :attr:`FleetState.states`; retry moves and
replication through Redis iterate that registry, so no core file names it. The fields are the
core's own tables, each read and written by several features (scoring, admission, the response
hooks, the shared-state loop), so none belongs to one plugin: the state store, in-flight work,
passive health, the latency model and flow control's queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.state.group_queues import GroupQueues
from epp.state.health import HealthTracker
from epp.state.inflight import InflightTracker
from epp.state.latency import LatencyModel
from epp.state.memory import MemoryStore
from epp.state.registry import States
from epp.state.store import StateStore


@dataclass
class FleetState:
    store: StateStore = field(default_factory=MemoryStore)
    inflight: InflightTracker = field(default_factory=InflightTracker)
    # Each endpoint's circuit, judged from the responses it served (passive health).
    health: HealthTracker = field(default_factory=HealthTracker)
    # Each endpoint's learned prefill rate, queueing and decode speed (the latency model).
    latency: LatencyModel = field(default_factory=LatencyModel)
    # Flow control's ledger and the other epp processes' queues (cluster-wide bands, fairness).
    queues: GroupQueues = field(default_factory=GroupQueues)
    # Plugins' own long-lived states (epp.state.registry), one instance per key.
    states: States = field(default_factory=States)
