"""The local HA stack (``make run-ha``) survives a dead epp: the supervisor reports it, the
other epp keeps serving, and the dead one is restarted and takes requests again, as the compose
stack's ``restart: unless-stopped`` would do. Before, one dead epp stopped Envoy and everything
(measured: 390 of the next 398 requests refused).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from epp.devstack import Proc, Stack, http_ok
from tests.e2e.test_active_active import (  # the same load and stack as the HA tests
    Load,
    epp_metric,
    ha_stack,
    own_redis,
    wait_for,
    warm_up,
)
from tests.helpers import redis_servers

__all__ = ["own_redis"]  # a fixture used below


def routed_by(stack: Stack, index: int) -> float:
    samples = epp_metric(stack, index, "epp_requests_total")
    return sum(v for labels, v in samples.items() if 'outcome="routed"' in labels)


def test_sigkilled_epp_is_reported_restarted_and_serves_again(
    tmp_path: Path, own_redis: redis_servers.RedisServer
) -> None:
    reports: list[str] = []
    done = threading.Event()
    with ha_stack(tmp_path, own_redis.url) as stack:
        stack.start()
        warm_up(stack)
        supervisor = threading.Thread(
            target=stack.supervise_until, args=(done.is_set, reports.append), daemon=True
        )
        supervisor.start()
        try:
            with Load(stack.url) as load:
                wait_for(lambda: len(load.outcomes) >= 20, 10.0, "20 requests before the kill")
                victim = stack.procs["epp1"]
                old_pid = victim.popen.pid
                killed_at = time.monotonic()
                victim.kill()
                dead_at = time.monotonic()
                back_in = wait_for(
                    lambda: (
                        victim.popen.pid != old_pid
                        and http_ok(f"http://127.0.0.1:{stack.epp_ports[1][2]}/metrics")
                    ),
                    15.0,
                    "epp1 restarted and answering",
                )
                routed_before = routed_by(stack, 1)
                wait_for(
                    lambda: routed_by(stack, 1) >= routed_before + 5,
                    15.0,
                    "the restarted epp1 routing requests again",
                )
                served_after = len([o for o in load.outcomes if o.started > dead_at])
        finally:
            done.set()
            supervisor.join(5)

        failures = load.failures()
        print(
            f"\nepp1 SIGKILLed: back in {back_in:.2f} s; {len(failures)} of "
            f"{len(load.outcomes)} requests failed, {served_after} served after the kill; "
            f"reports: {[r.splitlines()[0] for r in reports]}"
        )
        # The stack kept serving: only requests in flight on the dead epp may fail.
        assert all(o.started <= dead_at and o.ended >= killed_at for o in failures), failures
        assert len(failures) <= load.clients
        assert served_after >= 20
        assert stack.procs["envoy"].alive()
        assert stack.procs["epp0"].alive()
        # The death was reported with its exit code, and the restart too.
        assert any(r.startswith("epp1 exited with code -9") for r in reports), reports
        assert any(r.startswith("epp1 restarted") for r in reports), reports
        assert victim.restarts == 1
        assert not any(r.startswith(("epp0", "envoy", "sim")) for r in reports), reports


def test_restart_backoff_doubles_while_a_process_keeps_dying(tmp_path: Path) -> None:
    """A process that dies at once is restarted after 0.1 s, then 0.2 s, 0.4 s ...: a crash
    loop does not spin; one that ran long enough starts over at 0.1 s."""
    stack = Stack(tmp_path, replicas=1)
    tmp_path.mkdir(exist_ok=True)
    proc = stack.procs["crasher"] = Proc.start("crasher", ["false"], tmp_path)
    proc.popen.wait()
    reports: list[str] = []
    delays = []
    now = proc.started
    for _ in range(4):
        stack.supervise(reports.append, now)  # reports the death, schedules the restart
        delays.append(proc.restart_delay)
        assert proc.restart_due is not None
        now = proc.restart_due
        stack.supervise(reports.append, now)  # restarts it
        proc.popen.wait()
    assert delays == [0.1, 0.2, 0.4, 0.8]
    assert proc.restarts == 4
    assert "crasher exited with code 1" in reports[0]
    # A run longer than RESTART_RESET_AFTER resets the backoff.
    stack.supervise(reports.append, proc.started + 60)
    assert proc.restart_delay == 0.1
    # A process stopped on purpose stays stopped.
    proc.stop()
    proc.restart_due = None
    stack.supervise(reports.append, proc.started + 120)
    assert proc.restart_due is None
