"""The scheduler's waiting queue under vLLM's two scheduling policies (`--scheduling-policy`).

fcfs: arrival order; a preempted request goes back to the front. priority: ordered by the
request body's `priority` (lower value first), then arrival time, whatever the order of
insertion, so a preempted request simply rejoins by its key (vLLM's PriorityRequestQueue has
no front either). See docs/simulator.md for what was checked in vLLM's source.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from epp.sim.request import SimRequest


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(Protocol):
    """What the scheduler needs from its waiting queue."""

    def add(self, req: SimRequest) -> None:
        """A new arrival."""

    def prepend(self, req: SimRequest) -> None:
        """A request coming back (preempted, or skipped this step)."""

    def peek(self) -> SimRequest: ...

    def pop(self) -> SimRequest: ...

    def remove(self, req: SimRequest) -> None: ...

    def __contains__(self, req: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[SimRequest]:
        """In the order the requests would be served."""


class FcfsQueue:
    def __init__(self) -> None:
        self._items: deque[SimRequest] = deque()

    def add(self, req: SimRequest) -> None:
        self._items.append(req)

    def prepend(self, req: SimRequest) -> None:
        self._items.appendleft(req)

    def peek(self) -> SimRequest:
        return self._items[0]

    def pop(self) -> SimRequest:
        return self._items.popleft()

    def remove(self, req: SimRequest) -> None:
        self._items.remove(req)

    def __contains__(self, req: object) -> bool:
        return req in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[SimRequest]:
        return iter(self._items)


class PriorityQueue:
    """A heap on (priority, arrival time); the insertion count breaks the remaining ties
    (vLLM falls back to the request id, which is as arbitrary)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, SimRequest]] = []
        self._count = itertools.count()

    def add(self, req: SimRequest) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._count), req))

    prepend = add

    def peek(self) -> SimRequest:
        return self._heap[0][3]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: SimRequest) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not req]
        heapq.heapify(self._heap)

    def __contains__(self, req: object) -> bool:
        return any(entry[3] is req for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[SimRequest]:
        return (entry[3] for entry in sorted(self._heap))


def make_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityQueue() if policy is SchedulingPolicy.PRIORITY else FcfsQueue()
