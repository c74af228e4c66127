"""Flow control: hold requests on their ext_proc stream while their pool is saturated.

A held request is simply a stream epp has not answered yet: its coroutine awaits a future in a
:class:`~epp.admission.flow_queue.FlowQueue`. One dispatch task re-checks saturation whenever a
request finishes (:meth:`FlowController.wake`, called from the response path) and on a short
timer while anything is queued (never a busy loop: with an empty queue it sleeps until woken).
It releases one request at a time and yields, so the released request routes (and is counted in
flight) before saturation is checked again: holding never starves the fleet, and never floods it.

A client that goes away cancels its stream's coroutine: its entry leaves the queue at once and it
is never routed.

The queue is per process, its order group-wide: with a :class:`~epp.state.group_queues.GroupQueues`
view of the other epps' queues (exchanged through Redis in the background), the dispatcher
picks the flow the group has served least and yields a freed slot, for at most the view's
``hold`` time, to a higher band or an under-served flow waiting in another process. With no
fresh view (memory store, Redis down) it orders its own queue alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from epp.admission.flow_queue import Dropped, FlowQueue, QueueLimits
from epp.admission.flows import FlowBound
from epp.errors import RequestError
from epp.observability import FLOW_DROPPED, FLOW_QUEUE_DURATION, FLOW_QUEUE_SIZE
from epp.state.group_queues import GroupQueues

# How often a non-empty queue re-checks saturation without a completion to wake it (scraped
# metrics change between completions too).
TICK_SECONDS = 0.005
DROPPED_REASON_HEADER = "x-epp-request-dropped-reason"

_Waiter = asyncio.Future[None]


class FlowController:
    """Per-pool queues (keyed by the model whose candidates they wait for) and their dispatcher."""

    def __init__(
        self,
        limits: QueueLimits,
        saturated: Callable[[str, int], bool],
        clock: Callable[[], float] = time.monotonic,
        group: GroupQueues | None = None,
    ) -> None:
        self._limits = limits
        self._saturated = saturated
        self._clock = clock
        # The group's view (its ``now`` is this clock's); None, ``use_group`` off or a stale
        # view: local order.
        self._group = group
        self.use_group = True
        self._queues: dict[str, FlowQueue[_Waiter]] = {}
        # Which fairness ids and priorities requests are kept under (set before admit), and
        # the queue-size gauge's live label sets: a set that empties is removed, and the
        # labels name configured tenants and priorities only (epp.admission.flows).
        self.bound = FlowBound()
        self._held: dict[tuple[str, str, str], int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def limits(self) -> QueueLimits:
        return self._limits

    @limits.setter
    def limits(self, limits: QueueLimits) -> None:
        # A reload applies to requests queued from now on; queued ones keep their deadlines.
        self._limits = limits
        for queue in self._queues.values():
            queue.limits = limits

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def admit(self, key: str, priority: int, flow: str) -> None:
        """Return when the request may be routed; raise a 429/503 :class:`RequestError` when
        it is refused. Cancelling the caller (the client left) removes it from the queue."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = FlowQueue(self._limits)
        # Nobody waiting at this priority or above (here or, with the group's view, in another
        # process), and room in the pool for it: no queueing at all (the common case; and
        # critical work never waits behind held batch work).
        head = queue.head_priority()
        group = self._group if self.use_group else None
        if (
            (head is None or head < priority)
            and not (group is not None and group.waiting(key, priority, self._clock()))
            and not self._saturated(key, priority)
        ):
            return
        started = self._clock()
        waiter: _Waiter = asyncio.get_running_loop().create_future()
        entry, dropped = queue.push(waiter, priority, flow, started)
        if entry is None:
            (refused,) = dropped
            FLOW_DROPPED.labels(key, refused.reason).inc()
            raise _refusal(refused)
        for d in dropped:  # sheddable entries this arrival displaced
            _refuse(key, d)
        labels = (key, self.bound.priority_label(priority), self.bound.flow_label(flow))
        self._count(labels, 1)
        if self._group is not None:
            self._group.queued(key, priority, flow, 1, started)
        self._ensure_running()
        self._wake.set()
        try:
            await waiter
        except asyncio.CancelledError:
            queue.remove(entry)
            raise
        finally:
            self._count(labels, -1)
            if self._group is not None:
                self._group.queued(key, priority, flow, -1, self._clock())
            FLOW_QUEUE_DURATION.labels(key, labels[1], _outcome(waiter)).observe(
                self._clock() - started
            )

    def _count(self, labels: tuple[str, str, str], change: int) -> None:
        held = self._held.get(labels, 0) + change
        if held:
            self._held[labels] = held
            FLOW_QUEUE_SIZE.labels(*labels).set(held)
        else:
            del self._held[labels]
            FLOW_QUEUE_SIZE.remove(*labels)

    def wake(self) -> None:
        """A request finished: room may have freed, re-check now rather than at the next tick."""
        if self.queued():
            self._wake.set()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="flow-control")

    async def _run(self) -> None:
        while True:
            if self.queued():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), TICK_SECONDS)
            else:
                await self._wake.wait()
            self._wake.clear()
            await self._dispatch()

    async def _dispatch(self) -> None:
        for key, queue in list(self._queues.items()):
            for d in queue.expire(self._clock()):
                _refuse(key, d)
            group = self._group if self.use_group else None
            while (head := queue.head_priority()) is not None:
                if self._saturated(key, head):
                    if group is not None:
                        group.no_room(key)
                    break
                now = self._clock()
                flows = queue.flows(head)
                flow = flows[0] if group is None else group.pick(key, head, flows, now)
                if flow is None:
                    break  # yielding this room to another process; re-checked next tick
                entry = queue.pop(now, flow)
                if entry is None:
                    break
                if self._group is not None:
                    self._group.dispatched(key, entry.priority, entry.flow, now)
                if not entry.payload.done():
                    entry.payload.set_result(None)
                    # Let the released request route (and count in flight) before re-checking.
                    await asyncio.sleep(0)
            if not queue and group is not None:
                group.no_room(key)


def _refusal(dropped: Dropped[_Waiter]) -> RequestError:
    if dropped.status == 503:
        message = (
            f"The request waited {dropped.entry.deadline - dropped.entry.enqueued:.0f} s for "
            f"room in a saturated pool. Retry after {dropped.retry_after} s."
        )
        kind = "server_error"
    else:
        message = (
            "The pool is saturated and its queue for this priority is full. "
            f"Retry after {dropped.retry_after} s or send it with a higher priority."
        )
        kind = "rate_limit_error"
    return RequestError(
        dropped.status,
        message,
        type=kind,
        code=dropped.reason,
        headers={"retry-after": str(dropped.retry_after), DROPPED_REASON_HEADER: dropped.reason},
    )


def _refuse(key: str, dropped: Dropped[_Waiter]) -> None:
    FLOW_DROPPED.labels(key, dropped.reason).inc()
    if not dropped.entry.payload.done():
        dropped.entry.payload.set_exception(_refusal(dropped))


def _outcome(waiter: _Waiter) -> str:
    if waiter.cancelled() or not waiter.done():
        return "cancelled"
    return "dispatched" if waiter.exception() is None else "rejected"
