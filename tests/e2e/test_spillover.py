"""Spillover through the real Envoy: batch goes to the overflow pool's gateway only while the
home pool is saturated (and the overflow is not); critical never does."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from epp.devstack import Stack
from tests.e2e.client import Reply, completion, metric_values
from tests.e2e.conftest import make_stack
from tests.e2e.fleet import wait_until
from tests.e2e.test_routing import set_fault

BATCH = {"x-gateway-inference-objective": "batch"}
CRITICAL = {"x-gateway-inference-objective": "critical"}


def _epp_metric(stack: Stack, name: str) -> dict[str, float]:
    return metric_values(f"http://127.0.0.1:{stack.epp_ports[0][2]}/metrics", name)


def _background(url: str, into: list[Reply], prompt: str, **headers: str) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: into.append(completion(url, prompt, 2, **headers)), daemon=True
    )
    thread.start()
    return thread


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
        "request": {"objectives": {"critical": 10, "batch": {"priority": -1, "spill": True}}},
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
        _background(stack.url, fill, "fills home")
        wait_until(
            lambda: sum(_epp_metric(stack, "epp_endpoint_picks_total").values()) == 2,
            10,
            "the home replica holds one request",
        )

        # Batch spills to the overflow gateway (through its own Envoy cluster).
        spilled = completion(stack.url, "batch while home is full", **BATCH)
        assert spilled.status == 200, spilled.body
        assert spilled.served_by == remote
        assert _epp_metric(stack, "epp_spilled_requests_total") == {
            '{model="tiny",overflow="remote"}': 1.0
        }

        # Critical never spills: it waits (held) for home.
        critical: list[Reply] = []
        _background(stack.url, critical, "critical while home is full", **CRITICAL)
        wait_until(
            lambda: any(_epp_metric(stack, "inference_extension_flow_control_queue_size").values()),
            10,
            "critical is held",
        )

        # The overflow is saturated too (its max_requests: one spill hangs there): batch waits.
        set_fault(remote, hang=True)
        hanging: list[Reply] = []
        _background(stack.url, hanging, "batch that hangs in the overflow", **BATCH)
        wait_until(
            lambda: sum(_epp_metric(stack, "epp_spilled_requests_total").values()) == 2,
            10,
            "the second batch spilled",
        )
        waiting: list[Reply] = []
        _background(stack.url, waiting, "batch while both are full", **BATCH)
        wait_until(
            lambda: (
                sum(_epp_metric(stack, "inference_extension_flow_control_queue_size").values()) == 2
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
        assert sum(_epp_metric(stack, "epp_spilled_requests_total").values()) == 2
