"""Spillover through the real Envoy: batch goes to the overflow pool's gateway only while the
home pool is saturated (and the overflow is not); critical never does."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.devstack import Stack
from tests.e2e.client import Reply, completion
from tests.e2e.conftest import make_stack
from tests.e2e.fleet import completion_in_background, epp_metric, wait_until
from tests.e2e.test_routing import set_fault

BATCH = {"x-gateway-inference-objective": "batch"}
CRITICAL = {"x-gateway-inference-objective": "critical"}


def _held(stack: Stack) -> float:
    return sum(epp_metric(stack, 0, "inference_extension_flow_control_queue_size").values())


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
def test_batch_spills_only_while_home_is_saturated(tmp_path: Path, mode: str) -> None:
    # Replica 0 is the home pool; replica 1 stands for the other region: Envoy reaches it as
    # the overflow's gateway (its own cluster) and epp scrapes its metrics.
    stack = make_stack(tmp_path, mode, "memory", replicas=2)
    home, remote = stack.replica_addresses
    stack.config_extra = {
        "pools": {"main": {"endpoints": [home], "overflow": ["remote"]}},
        "overflow": {"remote": {"gateway": [remote], "endpoints": [remote], "max_requests": 1}},
        # One request in flight makes the home replica full.
        "admission": {"mode": "queue", "max_requests": 1, "ttl": 20},
        "request": {
            "objectives": {"critical": 10, "batch": {"priority": -1, "spill": True}},
            "trusted_headers": True,  # the objective header stands for a gateway in front
        },
    }
    with stack:
        stack.start()
        # Home has room: batch stays home.
        reply = completion(stack.url, "batch while home has room", **BATCH)
        assert reply.status == 200, reply.body
        assert reply.served_by == home

        # Saturate home: one request hangs on the home replica.
        set_fault(home, hang=True)
        fill: list[Reply] = []
        completion_in_background(stack.url, fill, "fills home")
        wait_until(
            lambda: sum(epp_metric(stack, 0, "epp_endpoint_picks_total").values()) == 2,
            10,
            "the home replica holds one request",
        )

        # Batch spills to the overflow gateway (through its own Envoy cluster).
        spilled = completion(stack.url, "batch while home is full", **BATCH)
        assert spilled.status == 200, spilled.body
        assert spilled.served_by == remote
        assert epp_metric(stack, 0, "epp_spilled_requests_total") == {
            '{model="tiny",overflow="remote"}': 1.0
        }

        # Critical never spills: it waits (held) for home.
        critical: list[Reply] = []
        completion_in_background(stack.url, critical, "critical while home is full", **CRITICAL)
        wait_until(
            lambda: any(
                epp_metric(stack, 0, "inference_extension_flow_control_queue_size").values()
            ),
            10,
            "critical is held",
        )

        # The overflow is saturated too (its max_requests: one spill hangs there): batch waits.
        set_fault(remote, hang=True)
        hanging: list[Reply] = []
        completion_in_background(stack.url, hanging, "batch that hangs in the overflow", **BATCH)
        wait_until(
            lambda: sum(epp_metric(stack, 0, "epp_spilled_requests_total").values()) == 2,
            10,
            "the second batch spilled",
        )
        waiting: list[Reply] = []
        completion_in_background(stack.url, waiting, "batch while both are full", **BATCH)
        wait_until(
            lambda: (
                sum(epp_metric(stack, 0, "inference_extension_flow_control_queue_size").values())
                == 2
            ),
            10,
            "critical and the last batch are held",
        )

        # Home frees: the held requests are served at home, critical first.
        set_fault(home, hang=False)
        set_fault(remote, hang=False)
        wait_until(lambda: len(critical) == len(waiting) == len(hanging) == 1, 30, "all served")
        assert critical[0].status == 200, critical[0].body
        assert critical[0].served_by == home
        assert waiting[0].status == 200
        assert waiting[0].served_by == home
        assert hanging[0].status == 200
        assert hanging[0].served_by == remote
        assert sum(epp_metric(stack, 0, "epp_spilled_requests_total").values()) == 2
