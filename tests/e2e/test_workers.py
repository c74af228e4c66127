"""``epp serve --workers 2`` behind a real Envoy: both workers decide, prefix groups stick as with
one process, and a worker that dies is restarted by the parent.

Real processes: Envoy rendered as ``epp envoy-config --workers`` renders it, one ``epp serve
--workers 2`` (a supervisor and two workers), a ``redis-server`` of the test's own, simulated
replicas with prefix caches.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.devstack import Stack
from tests.e2e.client import completion
from tests.e2e.test_active_active import (
    PROFILE,
    SIM_ARGS,
    STEADY_HEALTH,
    ha_stack,
    needs_prefix_scorer,
    picks,
    prefix_groups,
    stickiness,
    wait_for,
)
from tests.helpers import redis_servers

pytestmark = pytest.mark.skipif(not redis_servers.available(), reason="redis-server not installed")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[redis_servers.RedisServer]:
    server = redis_servers.RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def workers_stack(tmp: Path, redis_url: str, workers: int = 2) -> Stack:
    return Stack(
        tmp,
        replicas=3,
        workers=workers,
        redis_url=redis_url,
        config_extra={
            "scheduling": PROFILE,
            "store": {"key_prefix": f"w-{uuid.uuid4().hex[:8]}"},
            # It compares prefix hit rates, which a latency ejection on a busy machine muddles
            # (test_active_active.STEADY_HEALTH says why); errors still eject.
            "health": STEADY_HEALTH,
        },
        sim_args=SIM_ARGS,
    )


def worker_pids(stack: Stack) -> list[int]:
    parent = stack.procs["epp0"].popen.pid
    text = Path(f"/proc/{parent}/task/{parent}/children").read_text()
    return sorted(int(p) for p in text.split())


def test_two_workers_both_decide_and_match_one_process_hit_rate(
    tmp_path: Path, own_redis: redis_servers.RedisServer
) -> None:
    needs_prefix_scorer()
    with ha_stack(tmp_path / "one", None, epps=1, health=STEADY_HEALTH) as single:
        single.start()
        _, single_rate = prefix_groups(single)
    with workers_stack(tmp_path / "two", own_redis.url) as stack:
        stack.start()
        assert len(worker_pids(stack)) == 2
        before = [sum(picks(stack, i).values()) for i in range(2)]
        served, workers_rate = prefix_groups(stack)
        by_worker = [sum(picks(stack, i).values()) - before[i] for i in range(2)]
    print(
        f"\nprefix hit rate: one process {single_rate:.3f}, two workers {workers_rate:.3f}; "
        f"decisions per worker {by_worker}; stickiness {stickiness(served):.3f}"
    )
    assert min(by_worker) > 0, "Envoy should spread streams over both workers"
    assert stickiness(served) >= 0.95, dict(served)
    assert workers_rate >= single_rate - 0.05


def test_a_killed_worker_is_restarted_and_routes_again(
    tmp_path: Path, own_redis: redis_servers.RedisServer
) -> None:
    with workers_stack(tmp_path, own_redis.url) as stack:
        stack.start()
        old = worker_pids(stack)
        victim = old[1]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: len(worker_pids(stack)) == 2 and victim not in worker_pids(stack),
            10.0,
            "a new worker in place of the killed one",
        )
        assert stack.procs["epp0"].alive(), "the supervisor itself must survive"
        # Both workers decide again once Envoy's health checks see the new one.
        before = [sum(picks(stack, i).values()) if stack.endpoint_ready(i) else 0 for i in (0, 1)]
        deadline = time.monotonic() + 15

        def both_routed() -> bool:
            assert time.monotonic() < deadline, "the restarted worker never routed"
            assert completion(stack.url, f"after {uuid.uuid4().hex}", 1).status == 200
            try:
                now = [sum(picks(stack, i).values()) for i in (0, 1)]
            except OSError:
                return False
            return all(n > b for n, b in zip(now, before, strict=True))

        wait_for(both_routed, 20.0, "both workers routing after the restart")
