"""End-to-end with data-parallel replicas: real Envoy + epp + ``epp sim --data-parallel-size 2``.

Two simulated servers, each running two engines behind one port. epp schedules the four ranks
as endpoints of their own, sends each request to its replica's address and names the rank in
``x-data-parallel-host-port``; the simulator serves a request on the rank that header names
and says which in ``x-served-rank``.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from epp.devstack import Stack, free_port_run
from tests.e2e.client import Reply, completion, request
from tests.e2e.conftest import BODY_MODES, make_stack
from tests.e2e.fleet import epp_metric, wait_until

RANKS = 2


@pytest.fixture(scope="module", params=BODY_MODES)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    base = free_port_run(2 * RANKS)
    s = make_stack(
        tmp_path_factory.mktemp("data-parallel"),
        request.param,
        "memory",
        replicas=2,
        sim_base_port=base,
        config_extra={"admission": {"mode": "off"}},
        sim_args=["--data-parallel-size", str(RANKS), "--time-scale", "0.05"],
    )
    # The simulator spaces its replicas by the rank count: rank r answers to port + r.
    s.replica_addresses = [f"127.0.0.1:{base}", f"127.0.0.1:{base + RANKS}"]
    s.config_extra["pools"] = {
        "main": {"endpoints": s.replica_addresses, "data_parallel": {"size": RANKS}}
    }
    s.start()
    try:
        wait_until(lambda: len(ready_endpoints(s)) == 2 * RANKS, 15, "four ranks ready")
        yield s
    finally:
        s.stop()


def ready_endpoints(stack: Stack) -> set[str]:
    url = f"http://127.0.0.1:{stack.epp_ports[0][2]}/debug/endpoints"
    with urllib.request.urlopen(url, timeout=2) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return {address for address, e in data.items() if e["ready"]}


def rank_of(reply: Reply) -> str:
    """The rank endpoint that served, named as epp names it (replica port + rank)."""
    assert reply.served_by is not None
    host, _, port = reply.served_by.rpartition(":")
    return f"{host}:{int(port) + int(reply.headers['x-served-rank'])}"


def test_each_rank_is_an_endpoint_and_requests_land_on_the_rank_epp_named(stack: Stack) -> None:
    base, other = (int(a.rpartition(":")[2]) for a in stack.replica_addresses)
    assert ready_endpoints(stack) == {f"127.0.0.1:{p}" for p in (base, base + 1, other, other + 1)}
    replies: list[Reply] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        # A client's own rank header must not reach a replica (it would pick the rank).
        reply = completion(stack.url, f"question {i} " * 20, 40, **{"x-data-parallel-rank": "0"})
        with lock:
            replies.append(reply)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status for r in replies] == [200] * 16, [r.body for r in replies]
    served = Counter(rank_of(r) for r in replies)
    # Concurrent requests spread over the ranks: each rank's own queue counts.
    assert len(served) >= 3, served
    assert {int(r.headers["x-served-rank"]) for r in replies} == {0, 1}
    # What epp picked is what served: the header took each request to its rank.
    picks = {
        labels.split('endpoint="')[1].split('"')[0]: value
        for labels, value in epp_metric(stack, 0, "epp_endpoint_picks_total").items()
    }
    assert {a: v for a, v in picks.items() if v} == dict(served)
    for address in stack.replica_addresses:
        seen = request(f"http://{address}", "/admin/headers").json()
        assert seen.get("x-data-parallel-host-port", 0) == served_on(served, address)
        assert "x-data-parallel-rank" not in seen


def served_on(served: Counter[str], replica: str) -> int:
    host, _, port = replica.rpartition(":")
    return sum(served[f"{host}:{int(port) + r}"] for r in range(RANKS))
