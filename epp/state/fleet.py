"""Long-lived routing state that outlives any one configuration: the scheduler's memory.

Plugins are rebuilt on every configuration reload; what they learn (in-flight work, prefix
indexes, sessions, the TTFT scorer's prefill backlog, endpoint health, each endpoint's learned
speed) must not be lost with
them, so it lives here, owned by the server and reached by plugins through the scheduling
:class:`~epp.scheduling.Cycle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.prefix.approximate import ApproximatePrefixIndex
from epp.prefix.precise import PreciseIndex
from epp.prefix.tokens import TokenizerRegistry
from epp.state.backlog import PrefillBacklog
from epp.state.cold_picks import ColdPicks
from epp.state.group_queues import GroupQueues
from epp.state.health import HealthTracker
from epp.state.inflight import InflightTracker
from epp.state.latency import LatencyModel
from epp.state.memory import MemoryStore
from epp.state.sessions import SessionTable
from epp.state.store import StateStore


@dataclass
class FleetState:
    store: StateStore = field(default_factory=MemoryStore)
    inflight: InflightTracker = field(default_factory=InflightTracker)
    prefix: ApproximatePrefixIndex = field(default_factory=ApproximatePrefixIndex)
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
