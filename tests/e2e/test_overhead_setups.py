"""The overhead benchmark's Python ext_proc set-ups route for real, in both body modes.

Each set-up is started as ``benchmarks.overhead`` starts it (the server and its front Envoy as
`epp envoy-config` renders it) against the benchmark's backend, whose replicas here also echo
the destination header they received: Envoy routes on the ``envoy.lb`` metadata alone, so the
replica that answered proves the metadata and the echo proves the header.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.overhead import Bench, backend_config, pool_config, start_setup
from epp.devstack import free_port
from epp.wire import DESTINATION
from tests.e2e.client import Reply, completion, request
from tests.e2e.conftest import BODY_MODES

SEEN = "x-destination-seen"


@dataclass
class Backend:
    bench: Bench
    config_path: Path
    replicas: list[str]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    workdir = tmp_path_factory.mktemp("overhead-setups")
    bench = Bench(workdir)
    ports = [free_port() for _ in range(3)]
    admin = free_port()
    boot = yaml.safe_load(backend_config(ports, admin))
    for listener in boot["static_resources"]["listeners"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        completions: dict[str, Any] = hcm["route_config"]["virtual_hosts"][0]["routes"][-1]
        completions["response_headers_to_add"].append(
            {"header": {"key": SEEN, "value": f"%REQ({DESTINATION})%"}}
        )
    config_path = workdir / "epp.yaml"
    config_path.write_text(yaml.safe_dump(pool_config(ports)))
    try:
        bench.envoy("backend", yaml.safe_dump(boot), admin)
        yield Backend(bench, config_path, [f"127.0.0.1:{p}" for p in ports])
    finally:
        for proc in list(bench.procs):
            proc.stop()


@pytest.fixture
def start(backend: Backend) -> Iterator[Callable[[str, str], str]]:
    """Start a set-up (name, body mode) on the backend; its URL. Stopped after the test."""
    bench = backend.bench
    before = set(map(id, bench.procs))

    def start(setup: str, mode: str) -> str:
        probe = b'{"model": "tiny", "prompt": "ready?", "max_tokens": 1}'
        server, port = start_setup(bench, setup, mode, backend.config_path, sys.executable, probe)
        assert server.alive()
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in [p for p in bench.procs if id(p) not in before]:
        bench.stop(proc)


def _routed(reply: Reply) -> str:
    """The replica that answered, after checking it got the header naming it."""
    assert reply.status == 200, reply.body
    assert reply.served_by is not None
    assert reply.headers[SEEN] == reply.served_by
    return reply.served_by


@pytest.mark.parametrize("mode", BODY_MODES)
def test_floor_spreads_requests_over_every_replica_it_names(
    backend: Backend, start: Callable[[str, str], str], mode: str
) -> None:
    url = start("floor", mode)
    served = [_routed(completion(url, "lorem ipsum " * n)) for n in (1, 80, 700, 3, 4, 5)]
    # One pick in turn per request: every replica twice, in a fixed cycle.
    assert sorted(served) == sorted(backend.replicas * 2)
    assert served[:3] == served[3:]


@pytest.mark.parametrize("mode", BODY_MODES)
def test_floor_refuses_a_body_that_names_no_model(
    backend: Backend, start: Callable[[str, str], str], mode: str
) -> None:
    url = start("floor", mode)
    for body in (b"{not json", b'{"prompt": "no model"}', b'["tiny"]'):
        reply = request(url, "/v1/completions", body)
        assert reply.status == 400, reply.body
        assert reply.json()["error"]["code"] == "invalid_request"
        assert reply.served_by is None
    assert _routed(completion(url, "still routing")) in backend.replicas


@pytest.mark.parametrize("mode", BODY_MODES)
def test_noop_routes_everything_to_its_one_replica(
    backend: Backend, start: Callable[[str, str], str], mode: str
) -> None:
    url = start("noop", mode)
    served = {_routed(completion(url, "lorem ipsum " * n)) for n in (1, 80, 700)}
    assert served == {backend.replicas[0]}
