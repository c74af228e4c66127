"""The flow-control queue's order, fairness, TTL, capacity and cancellation, on a fake clock."""

from __future__ import annotations

from collections import Counter

from epp.admission.flow_queue import BandLimits, FlowQueue, QueueLimits


def _queue(capacity: int = 100, band_capacity: int = 100, ttl: float = 10.0) -> FlowQueue[str]:
    return FlowQueue(QueueLimits(capacity, BandLimits(band_capacity, ttl)))


def _drain(queue: FlowQueue[str], now: float = 0.0) -> list[str]:
    out = []
    while (entry := queue.pop(now)) is not None:
        out.append(entry.payload)
    return out


def test_highest_band_first_then_fcfs_within_a_flow() -> None:
    queue = _queue()
    queue.push("batch-1", -1, "t", 0.0)
    queue.push("default-1", 0, "t", 0.1)
    queue.push("critical-1", 10, "t", 0.2)
    queue.push("default-2", 0, "t", 0.3)
    queue.push("critical-2", 10, "t", 0.4)
    assert _drain(queue) == ["critical-1", "critical-2", "default-1", "default-2", "batch-1"]


def test_flows_in_a_band_share_dispatches_equally_whatever_they_offer() -> None:
    queue = _queue(capacity=10_000, band_capacity=10_000)
    # Tenant "big" offers ten times the load of "small" while the pool stays saturated.
    for i in range(1000):
        queue.push(f"big-{i}", 0, "big", i * 0.001)
        if i % 10 == 0:
            queue.push(f"small-{i}", 0, "small", i * 0.001)
    served: Counter[str] = Counter()
    # Dispatch while both still have work queued: the shares must be equal within 10%.
    for _ in range(180):
        entry = queue.pop(1.0)
        assert entry is not None
        served[entry.flow] += 1
    assert abs(served["big"] - served["small"]) <= 0.1 * served["small"], served


def test_ttl_expiry_drops_with_503_and_the_reason() -> None:
    queue = _queue(ttl=2.0)
    queue.push("old", 0, "t", 0.0)
    queue.push("young", 0, "t", 1.5)
    assert queue.next_deadline() == 2.0
    assert queue.expire(1.9) == []
    (dropped,) = queue.expire(2.0)
    assert (dropped.entry.payload, dropped.status, dropped.reason) == (
        "old",
        503,
        "rejected-ttl-expired",
    )
    assert dropped.retry_after >= 1
    assert _drain(queue) == ["young"]


def test_band_capacity_refuses_the_arrival_with_429() -> None:
    queue = _queue(band_capacity=2)
    queue.push("a", 0, "t", 0.0)
    queue.push("b", 0, "t", 0.0)
    entry, (dropped,) = queue.push("c", 0, "t", 0.0)
    assert entry is None
    assert (dropped.entry.payload, dropped.status, dropped.reason) == (
        "c",
        429,
        "rejected-saturated",
    )
    # Another band still has room.
    assert queue.push("d", 1, "t", 0.0)[0] is not None


def test_a_full_queue_sheds_sheddable_work_first() -> None:
    queue = _queue(capacity=3)
    queue.push("batch-old", -1, "t", 0.0)
    queue.push("batch-new", -1, "t", 1.0)
    queue.push("default", 0, "t", 2.0)
    entry, (evicted,) = queue.push("critical", 10, "t", 3.0)
    assert entry is not None
    assert (evicted.entry.payload, evicted.reason, evicted.status) == (
        "batch-new",
        "rejected-capacity-evicted",
        429,
    )
    # A sheddable arrival cannot displace anything: it is refused.
    entry, (refused,) = queue.push("batch-late", -1, "t", 4.0)
    assert entry is None
    assert refused.entry.payload == "batch-late"
    assert _drain(queue) == ["critical", "default", "batch-old"]


def test_a_cancelled_entry_leaves_at_once_and_is_never_dispatched() -> None:
    queue = _queue()
    gone, _ = queue.push("gone", 0, "t", 0.0)
    queue.push("stays", 0, "t", 0.1)
    assert gone is not None
    assert queue.remove(gone)
    assert len(queue) == 1
    assert not queue.remove(gone)
    assert _drain(queue) == ["stays"]


def test_retry_after_follows_the_measured_drain_rate_and_position() -> None:
    queue = _queue(capacity=10_000, band_capacity=10_000)
    for i in range(400):
        queue.push(f"r{i}", 0, "t", 0.0)
    # Dispatch 20 per second for 15 s: the smoothed rate converges near 20/s.
    for step in range(300):
        queue.pop(step * 0.05)
    rate = queue.drain_rate(15.0)
    assert 17 < rate < 21, rate
    # 100 entries ahead at ~20/s: about 5 s.
    assert 4 <= queue.retry_after(0, 15.0) <= 7
    # A higher band has nobody ahead of it.
    assert queue.retry_after(5, 15.0) == 1
    # A stalled pool is clamped to a minute, never "never".
    assert queue.retry_after(0, 1000.0) == 60
