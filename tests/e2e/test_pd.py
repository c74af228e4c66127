"""Prefill/decode disaggregation through a real Envoy, in both body modes: epp names a prefill
replica only for long uncached prompts, client copies of that header never reach the sidecar,
the sidecar's two legs leave the decode stream intact (SSE events and usage), and the sidecar
refuses a prefill target outside the pool and prefills locally when the prefill leg fails.

The fleet: simulated replica P (role prefill) and D (the decode engine), both with the NIXL
connector; ``epp pd-sidecar`` S in front of D (role decode). epp's pool is P and S."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from epp.devstack import Stack, free_port
from tests.e2e.client import Reply, metric_values, request
from tests.e2e.conftest import BODY_MODES
from tests.e2e.test_active_active import wait_for
from tests.helpers.pd_profiles import PROFILES


@dataclass
class PdFleet:
    stack: Stack
    prefill: str  # P
    engine: str  # D
    sidecar: str  # S
    dead: str  # an allowed prefill address nothing listens on

    def prefilled(self) -> float:
        """Requests P served (each prefill leg is one)."""
        values = metric_values(f"http://{self.prefill}/metrics", "vllm:request_success_total")
        return sum(values.values())

    def loaded(self) -> float:
        """Prompt tokens D loaded from P instead of prefilling them."""
        url = f"http://{self.engine}/metrics"
        return sum(metric_values(url, "vllm:external_prefix_cache_hits_total").values())

    def decisions(self, kind: str) -> float:
        url = f"http://127.0.0.1:{self.stack.epp_ports[0][2]}/metrics"
        name = "llm_d_inference_scheduler_disagg_decision_total"
        return metric_values(url, name).get(f'{{decision_type="{kind}"}}', 0.0)


class PdStack(Stack):
    """A stack whose pool is P and the sidecar (what it waits to see ready), its simulated
    replicas P and D, one process each (P can be stopped alone)."""

    engine = ""

    def start_sims(self) -> None:
        for name, address in (("sim0", self.replica_addresses[0]), ("sim1", self.engine)):
            port = address.rpartition(":")[2]
            argv = ["-m", "epp", "sim", "--port", port, "--model", self.model, *self.sim_args]
            self.spawn(name, [sys.executable, *argv])


@pytest.fixture(scope="module", params=BODY_MODES)
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PdFleet]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"pd-{mode}")
    stack = PdStack(
        tmp, replicas=2, mode=mode, sim_args=["--time-scale", "0.01", "--kv-connector", "nixl"]
    )
    prefill, engine = stack.replica_addresses
    sidecar, dead = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    stack.engine = engine
    stack.replica_addresses = [prefill, sidecar]
    stack.config_extra = {
        "pools": {
            "main": {
                "endpoints": [
                    {"address": prefill, "role": "prefill"},
                    {"address": sidecar, "role": "decode"},
                ]
            }
        },
        "scheduling": PROFILES,
    }
    tmp.mkdir(parents=True, exist_ok=True)
    stack.spawn(
        "sidecar",
        [
            sys.executable,
            "-m",
            "epp",
            "pd-sidecar",
            "--listen",
            sidecar,
            "--engine",
            f"http://{engine}",
            "--connector",
            "nixl",
            "--prefill",
            prefill,
            "--prefill",
            dead,
            "--prefill-timeout",
            "5",
        ],
    )
    with stack:
        stack.start()
        yield PdFleet(stack, prefill, engine, sidecar, dead)


def long_prompt() -> str:
    # Unique from its first characters: no earlier request's prefix is cached anywhere.
    return f"{uuid.uuid4().hex} " + "tell me more about disaggregated serving " * 60


def complete(
    base: str, prompt: str, headers: dict[str, str] | None = None, **body: object
) -> Reply:
    data = {"model": "tiny", "prompt": prompt, "max_tokens": 5, **body}
    return request(base, "/v1/completions", data, headers)


def test_long_prompts_are_disaggregated_short_ones_stay_local(fleet: PdFleet) -> None:
    url = fleet.stack.url
    prefilled, loaded = fleet.prefilled(), fleet.loaded()
    split = fleet.decisions("prefill-decode")
    reply = complete(url, long_prompt())
    assert reply.status == 200, reply.body[:300]
    assert reply.served_by == fleet.engine  # through the sidecar, to the decode engine
    assert reply.json()["usage"]["completion_tokens"] == 5
    assert fleet.prefilled() == prefilled + 1
    assert fleet.loaded() > loaded
    assert fleet.decisions("prefill-decode") == split + 1
    local, loaded = fleet.decisions("decode-only"), fleet.loaded()
    reply = complete(url, f"hi {uuid.uuid4().hex}")
    assert reply.status == 200
    assert reply.served_by == fleet.engine
    assert fleet.prefilled() == prefilled + 1
    assert fleet.loaded() == loaded
    assert fleet.decisions("decode-only") == local + 1


def test_client_copies_of_the_prefill_header_are_stripped(fleet: PdFleet) -> None:
    url = fleet.stack.url
    outside = f"127.0.0.1:{free_port()}"
    forged = {"x-prefiller-host-port": outside, "x-gateway-prefill-endpoints": outside}
    prefilled = fleet.prefilled()
    # Had the copy reached the sidecar, it would have refused it (403) or called P.
    short = complete(url, f"hi {uuid.uuid4().hex}", forged)
    assert short.status == 200, short.body[:300]
    assert fleet.prefilled() == prefilled
    # A disaggregated request carries epp's value, not the client's.
    forged = {"x-prefiller-host-port": fleet.dead}
    long = complete(url, long_prompt(), forged)
    assert long.status == 200, long.body[:300]
    assert fleet.prefilled() == prefilled + 1


def test_streaming_through_the_sidecar_is_intact(fleet: PdFleet) -> None:
    loaded = fleet.loaded()
    reply = complete(
        fleet.stack.url,
        long_prompt(),
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    text = reply.body.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [json.loads(b[len("data: ") :]) for b in text.split("\n\n")[:-2]]
    tokens = [e for e in events if e["choices"]]
    assert len(tokens) == 12
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert fleet.loaded() > loaded


def test_sidecar_refuses_a_prefill_target_outside_the_pool(fleet: PdFleet) -> None:
    prefilled = fleet.prefilled()
    outside = f"127.0.0.1:{free_port()}"
    reply = complete(f"http://{fleet.sidecar}", long_prompt(), {"x-prefiller-host-port": outside})
    assert reply.status == 403
    assert reply.json()["error"]["type"] == "permission_error"
    assert fleet.prefilled() == prefilled


def test_a_dead_prefill_replica_is_prefilled_locally(fleet: PdFleet) -> None:
    loaded = fleet.loaded()
    reply = complete(
        f"http://{fleet.sidecar}", long_prompt(), {"x-prefiller-host-port": fleet.dead}
    )
    assert reply.status == 200, reply.body[:300]
    assert reply.json()["usage"]["completion_tokens"] == 5
    assert fleet.loaded() == loaded


def test_epp_serves_decode_only_while_the_prefill_replica_is_down(fleet: PdFleet) -> None:
    """Last in the module: it stops P. epp sees it unready and stops naming it."""
    sim = fleet.stack.procs["sim0"]
    sim.stopped = True  # nobody restarts it
    sim.kill()
    wait_for(lambda: not fleet.stack.endpoint_ready(0), 10.0, "epp to see P gone")
    local = fleet.decisions("decode-only")
    reply = complete(fleet.stack.url, long_prompt())
    assert reply.status == 200, reply.body[:300]
    assert reply.served_by == fleet.engine
    assert fleet.decisions("decode-only") == local + 1
