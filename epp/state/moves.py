"""Move what a pick taught the fleet state to the endpoint that actually served it.

Envoy retries a failed attempt on epp's next fallback, so the endpoint that answers can differ
from the one epp picked. Everything the pick recorded for the picked endpoint then describes a
request it never ran: the in-flight ticket (the core's) and what the plugins' states declared
with ``moves=True`` recorded (:mod:`epp.state.registry`: the prefix blocks the approximate
index now believes the endpoint caches, the session binding). The stream handler records the
pick (:class:`Recording` around the post-pick hooks: every moving state notes its entries) and,
once the response names the endpoint that served, calls :func:`move_pick`, which asks each
noted entry to move itself; no table is named here. States declared without ``moves`` stay
where the pick put them: the TTFT scorer's prefill backlog and the precise index's speculative
entries are estimates that expire by themselves within seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.state.fleet import FleetState
from epp.state.inflight import Ticket
from epp.state.registry import Footprint, States


@dataclass(slots=True)
class PickRecord:
    """One pick's footprint in the fleet state."""

    ticket: Ticket
    learned: list[Footprint] = field(default_factory=list)
    # When the pick was made (the stream's clock), and the requests decoding on the endpoint
    # when its first token arrived (the latency model's decode batch).
    picked_at: float = 0.0
    decoding: int = 0
    # Prefill tokens ahead of the request's first token on the endpoint, as counted at the
    # pick: its uncached prompt plus the prefill queued ahead (passive health scales its TTFT
    # by them); None when unknown (a fallback served it).
    prefill_ahead: int | None = None
    # The TTFT measured at the first token, held for the latency model until the response's
    # usage says how many prompt tokens the engine had cached (Router.first_token).
    ttft_held: float | None = None

    @property
    def endpoint(self) -> str:
        return self.ticket.endpoint


class Recording:
    """``with Recording(states) as journal``: collect what the journaled states record inside
    the block (one synchronous decision). A class, not a generator-based context manager: it
    runs after every pick, and entering and leaving a generator costs several times as much."""

    __slots__ = ("_states",)

    def __init__(self, states: States) -> None:
        self._states = states

    def __enter__(self) -> list[Footprint]:
        journal: list[Footprint] = []
        for state in self._states.journaled:
            state.journal = journal
        return journal

    def __exit__(self, *_: object) -> None:
        for state in self._states.journaled:
            state.journal = None


def move_pick(fleet: FleetState, record: PickRecord, served: str, now: float) -> PickRecord:
    """The pick's accounting, moved from ``record.endpoint`` to ``served``; returns the new
    record (its ticket replaces the old one, which must not be released)."""
    source = record.endpoint
    if served == source:
        return record
    ticket = fleet.inflight.move(record.ticket, served)
    learned = []
    for item in record.learned:
        if item.endpoint != source:
            learned.append(item)
            continue
        with Recording(fleet.states) as journal:
            item.move(served, now)
        learned.extend(journal)
    return PickRecord(ticket, learned, record.picked_at, record.decoding)
