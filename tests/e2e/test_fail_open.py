"""``epp_unreachable`` per pool, through a real Envoy: with every epp gone, a pool that fails
closed answers 503 (OpenAI-style JSON) and a pool that fails open is still served, by Envoy's own
least-request balancer over its replicas; once epp is back, epp routes again. Only buffered mode
can fail open: Envoy fails a full-duplex request without its processor whatever
``failure_mode_allow`` says, so ``epp envoy-config`` refuses the combination.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from epp.devstack import Mode, Stack
from tests.e2e.client import completion
from tests.e2e.test_active_active import picks, wait_for


def stack_with(tmp: Path, mode: Mode, unreachable: str) -> Stack:
    stack = Stack(tmp, replicas=3, mode=mode, sim_args=["--time-scale", "0.01"])
    stack.config_extra["pools"] = {
        "main": {"endpoints": stack.replica_addresses, "epp_unreachable": unreachable}
    }
    return stack


def crash_epp(stack: Stack) -> None:
    epp = stack.procs["epp0"]
    epp.stopped = True  # nobody restarts it
    epp.kill()


def ok(stack: Stack) -> bool:
    return completion(stack.url, f"probe {uuid.uuid4().hex}", 2).status == 200


def test_fail_open_pool_is_served_by_envoy_while_no_epp_answers(tmp_path: Path) -> None:
    mode: Mode = "buffered"  # full-duplex cannot fail open (render refuses; unit tests)
    with stack_with(tmp_path, mode, "fail_open") as stack:
        stack.start()
        assert ok(stack)
        crash_epp(stack)
        served: set[str] = set()
        took = []
        for i in range(12):
            started = time.monotonic()
            reply = completion(stack.url, f"without epp {i} {uuid.uuid4().hex}", 2)
            took.append(time.monotonic() - started)
            assert reply.status == 200, reply.body[:300]
            assert reply.served_by in stack.replica_addresses
            served.add(reply.served_by)
        print(
            f"\nfail open ({mode}): 12 of 12 served by {sorted(served)}; slowest {max(took):.2f} s"
        )
        # Least request over the pool, not one replica.
        assert len(served) >= 2
        # epp back: it routes again (its picks count).
        epp = stack.procs["epp0"]
        epp.respawn()
        epp.stopped = False
        wait_for(lambda: stack.endpoint_ready(0), 20.0, "epp back with every replica ready")
        wait_for(lambda: ok(stack) and sum(picks(stack, 0).values()) > 0, 10.0, "epp routing again")


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
def test_fail_closed_pool_answers_503_json_while_no_epp_answers(tmp_path: Path, mode: Mode) -> None:
    with stack_with(tmp_path, mode, "fail_closed") as stack:
        stack.start()
        assert ok(stack)
        crash_epp(stack)
        reply = completion(stack.url, f"without epp {uuid.uuid4().hex}", 2)
        assert reply.status in (500, 503), reply
        error = reply.json()["error"]
        assert error["code"] in ("upstream_unavailable", "endpoint_picker_unavailable"), error
        assert reply.served_by is None
