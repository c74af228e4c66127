"""Cluster-wide flow control, the pure part: the group's view of every epp's queues, with a
fake clock (no Redis, no event loop). The exchange through Redis and two real controllers:
tests/unit/test_sync_flow_group.py."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from epp.admission.flow_queue import BandLimits, FlowQueue, QueueLimits
from epp.state.group_queues import IDLE_SECONDS, MARGIN, PRUNE_EVERY, SERVED_TAU, GroupQueues, Row

INTERVAL = 0.05


def _view(rows: list[Row], now: float, member: str = "b") -> GroupQueues:
    """A process that has seen ``member`` once with no rows, then with ``rows``."""
    group = GroupQueues(INTERVAL)
    group.apply({member: []}, now)
    group.apply({member: rows}, now)
    return group


def test_a_higher_band_waiting_elsewhere_takes_the_room() -> None:
    group = _view([Row("m", 10, "chat", 1, 0)], 0.0)
    assert group.choose("m", -1, ["evals"], 0.0) is None
    # The same band elsewhere does not stop this one (nothing served yet: no flow trails).
    assert group.choose("m", 10, ["chat-2"], 0.0) == "chat-2"
    # Another pool's critical work is no reason to idle this pool.
    assert group.choose("other", -1, ["evals"], 0.0) == "evals"
    assert group.waiting("m", 10, 0.0)
    assert group.waiting("m", -1, 0.0)
    assert not group.waiting("m", 11, 0.0)
    assert not group.waiting("other", 0, 0.0)


def test_an_over_served_flow_yields_to_one_waiting_only_elsewhere() -> None:
    group = _view([Row("m", 0, "light", 3, 0)], 0.0)
    for _ in range(2):
        group.dispatched("m", 0, "heavy", 0.0)
    assert group.choose("m", 0, ["heavy"], 0.0) is None
    # Once the other process has served light as often, heavy goes again.
    group.apply({"b": [Row("m", 0, "light", 3, 2)]}, 0.1)
    assert group.choose("m", 0, ["heavy"], 0.1) == "heavy"


def test_a_gap_below_the_margin_is_not_worth_idling_for() -> None:
    group = _view([Row("m", 0, "light", 1, 0)], 0.0)
    group.dispatched("m", 0, "heavy", 0.0)
    assert MARGIN == 1.0
    # Exactly one dispatch ahead: yield; the view's lag is about that much, not more.
    assert group.choose("m", 0, ["heavy"], 0.0) is None
    group.apply({"b": [Row("m", 0, "light", 1, 1)]}, 0.0)
    group.dispatched("m", 0, "heavy", 0.0)
    group.apply({"b": [Row("m", 0, "light", 1, 2)]}, 0.0)
    assert group.served("m", 0, "heavy", 0.0) == group.served("m", 0, "light", 0.0) == 2
    assert group.choose("m", 0, ["heavy"], 0.0) == "heavy"


def test_among_local_flows_the_least_served_goes_first_ties_in_turn() -> None:
    group = _view([Row("m", 0, "a", 0, 5), Row("m", 0, "b", 0, 1)], 0.0)
    # b's remote dispatches count only from the second sighting on.
    group.apply({"b": [Row("m", 0, "a", 0, 9), Row("m", 0, "b", 0, 2)]}, 0.0)
    assert group.choose("m", 0, ["a", "b", "c"], 0.0) == "c"
    assert group.choose("m", 0, ["a", "b"], 0.0) == "b"
    assert group.choose("m", 0, ["x", "y"], 0.0) == "x"  # tie: the round-robin's turn


def test_a_members_first_view_is_a_baseline_then_increases_count() -> None:
    group = GroupQueues(INTERVAL)
    group.apply({"b": [Row("m", 0, "f", 0, 500)]}, 0.0)
    assert group.served("m", 0, "f", 0.0) == 0
    group.apply({"b": [Row("m", 0, "f", 0, 503)]}, 0.0)
    assert group.served("m", 0, "f", 0.0) == 3
    # A row that vanished and comes back restarted its count (the publisher forgot it).
    group.apply({"b": []}, 0.0)
    group.apply({"b": [Row("m", 0, "f", 0, 2)]}, 0.0)
    assert group.served("m", 0, "f", 0.0) == 5


def test_served_counts_decay() -> None:
    group = GroupQueues(INTERVAL)
    group.dispatched("m", 0, "f", 0.0)
    assert group.served("m", 0, "f", SERVED_TAU) == pytest.approx(1 / 2.718281828, rel=1e-6)


def test_a_stale_or_lost_view_falls_back_to_the_local_order() -> None:
    group = _view([Row("m", 10, "chat", 1, 0)], 0.0)
    assert group.live(group.stale)
    assert group.pick("m", -1, ["evals"], 0.0) is None
    # Stale: the other process's critical work may be long gone; dispatch locally.
    later = group.stale + 0.001
    assert not group.live(later)
    assert not group.waiting("m", 10, later)
    assert group.pick("m", -1, ["evals"], later) == "evals"
    group.apply({"b": [Row("m", 10, "chat", 1, 0)]}, later)
    assert group.pick("m", -1, ["evals"], later) is None
    group.lose()
    assert group.pick("m", -1, ["evals"], later) == "evals"


def test_a_yield_is_bounded_then_the_room_is_used() -> None:
    group = _view([Row("m", 10, "chat", 1, 0)], 0.0)
    assert group.hold == 4 * INTERVAL
    assert group.pick("m", -1, ["evals"], 0.0) is None
    assert group.pick("m", -1, ["evals"], group.hold / 2) is None
    # Nobody took the room within the hold: work-conserving, the local head goes.
    assert group.pick("m", -1, ["evals"], group.hold) == "evals"
    # A new room starts a new yield; so does one after the pool was full in between.
    assert group.pick("m", -1, ["evals"], group.hold) is None
    group.no_room("m")
    assert group.pick("m", -1, ["evals"], group.hold * 1.9) is None


def test_export_publishes_held_and_recent_flows_and_forgets_idle_ones() -> None:
    group = GroupQueues(INTERVAL)
    group.queued("m", 0, "f", 1, 0.0)
    group.queued("m", 0, "g", 1, 0.0)
    group.queued("m", 0, "g", -1, 1.0)
    group.dispatched("m", 0, "g", 1.0)
    assert sorted(group.export(2.0), key=lambda r: r.flow) == [
        Row("m", 0, "f", 1, 0),
        Row("m", 0, "g", 0, 1),
    ]
    # g idle long enough: dropped, and its count starts again from 0.
    assert group.export(1.0 + IDLE_SECONDS) == [Row("m", 0, "f", 1, 0)]
    group.dispatched("m", 0, "g", 40.0)
    assert Row("m", 0, "g", 0, 1) in group.export(40.0)


# -- two processes, one pool: the group's order against each process's own --------------------


@dataclass
class _Process:
    name: str
    flows: tuple[str, ...]
    view: GroupQueues = field(default_factory=lambda: GroupQueues(INTERVAL))
    queue: FlowQueue[int] = field(default_factory=lambda: FlowQueue(QueueLimits(100, BandLimits())))
    running: list[float] = field(default_factory=list)  # finish times of its dispatches
    others_running: int = 0  # as of the last exchange


def _simulate(group: bool, seconds: float = 120.0, slots: int = 4) -> Counter[str]:
    """Dispatches per flow: ``heavy`` waits in both processes, ``light`` only in ``a``; both
    always have work waiting. Each process sees its own completions at once and the other's
    in-flight count and queues as of the last exchange (every INTERVAL), dispatching every
    5 ms, as epp does."""
    rng = random.Random(7)
    a, b = _Process("a", ("heavy", "light")), _Process("b", ("heavy",))
    procs = [a, b]
    served: Counter[str] = Counter()
    tick, t, next_exchange = 0.005, 0.0, 0.0
    while t < seconds:
        for p in procs:
            p.running = [f for f in p.running if f > t]
            for flow in p.flows:  # keep five of each flow waiting
                while p.queue.sizes().get((0, flow), 0) < 5:
                    p.queue.push(0, 0, flow, t)
                    p.view.queued("m", 0, flow, 1, t)
        if t >= next_exchange:
            next_exchange += INTERVAL
            rows = {p.name: p.view.export(t) for p in procs}
            for p in procs:
                other = b if p is a else a
                p.others_running = len(other.running)
                p.view.apply({other.name: rows[other.name]}, t)
        for p in rng.sample(procs, 2):
            while len(p.running) + p.others_running < slots:
                flows = p.queue.flows(0)
                flow = p.view.pick("m", 0, flows, t) if group else flows[0]
                if flow is None:
                    break
                entry = p.queue.pop(t, flow)
                assert entry is not None
                p.view.dispatched("m", 0, entry.flow, t)
                p.view.queued("m", 0, entry.flow, -1, t)
                p.running.append(t + rng.uniform(0.3, 0.7))
                served[entry.flow] += 1
            else:
                p.view.no_room("m")
        t += tick
    return served


def test_two_processes_share_out_dispatches_equally_only_with_the_group_view() -> None:
    alone = _simulate(group=False)
    together = _simulate(group=True)
    # Each process alone: a splits its share between heavy and light, b gives all to heavy.
    assert alone["heavy"] > 2.5 * alone["light"], alone
    assert abs(together["heavy"] - together["light"]) <= 0.1 * together["light"], together
    # Yielding costs little throughput: the pool stays nearly as busy.
    assert together.total() >= 0.9 * alone.total(), (together, alone)


def test_without_an_exchange_local_tables_stay_bounded() -> None:
    """The memory store never exports: tables are pruned by local updates alone."""
    group = GroupQueues(INTERVAL)
    for i in range(5000):
        now = i * 0.1  # a new tenant every 0.1 s, one request each
        group.queued("m", 0, f"tenant-{i}", 1, now)
        group.queued("m", 0, f"tenant-{i}", -1, now)
        group.dispatched("m", 0, f"tenant-{i}", now)
    # Tenants idle for IDLE_SECONDS (300 of them at this rate) and faded counts are gone.
    assert len(group.export(500.0)) <= IDLE_SECONDS / 0.1 + PRUNE_EVERY
    assert len(group._served) <= IDLE_SECONDS / 0.1 + PRUNE_EVERY
