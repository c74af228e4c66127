"""Model rewrite and InferenceObjective end to end, in both body modes: a real Envoy, an epp
following an InferencePool on a local Kubernetes API (tests/helpers/fake_kube.py) and a
simulated vLLM serving two LoRA adapters, whose answers name the model the forwarded body
carried. An InferenceModelRewrite splits ``chat`` 90/10 between the adapters: over 2,000
requests the share lands within 2 points; a session stays on one adapter; new weights take
effect with the one watch event that carries them, with no restart and no failed request; an
InferenceObjective changes a request's priority band live."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config import parse_config
from epp.devstack import Stack, free_port
from epp.envoy_config import render, seed_eds
from tests.e2e.client import metric_values, request
from tests.e2e.conftest import BODY_MODES
from tests.e2e.fleet import envoy_ready, epp_ready_endpoints, wait_until
from tests.helpers.fake_kube import (
    FakeKube,
    inference_objective,
    inference_pool,
    model_rewrite,
    objectives_kind,
    pod,
    rewrites_kind,
    split,
)

IP = "127.0.0.2"
APP = {"app": "vllm"}
REQUESTS = 2000
SPLIT_90_10 = [split("chat", ("chat-v1", 90), ("chat-v2", 10))]


@dataclass
class Canary:
    stack: Stack
    kube: FakeKube
    mode: str
    counter: Iterator[int] = field(default_factory=lambda: iter(range(10**9)))

    def ask(self, session: str | None = None, **headers: str) -> tuple[int, str | None]:
        """One completion for ``chat``: the status and the model the engine says it ran."""
        if session is not None:
            headers["x-session-token"] = session
        reply = request(
            self.stack.url,
            "/v1/completions",
            {"model": "chat", "prompt": f"hello {next(self.counter)}", "max_tokens": 1},
            headers,
            timeout=10,
        )
        model = reply.json().get("model") if reply.status == 200 else None
        return reply.status, model

    def split_to(self, *targets: tuple[str, int]) -> None:
        self.kube.put(
            rewrites_kind(), model_rewrite("canary", "vllm-pool", [split("chat", *targets)])
        )

    def rewrite_lists(self) -> int:
        """List requests (not watches) epp made for the rewrites: a relist would add one."""
        return sum(
            1
            for path, query in self.kube.requests
            if path.endswith("/inferencemodelrewrites") and query.get("watch") != "true"
        )


def write_configs(stack: Stack, api_url: str, eds_dir: Path, mode: str) -> None:
    data = stack.epp_config()
    kubernetes = {"pool_name": "vllm-pool", "namespace": "default", "api_url": api_url}
    data["pools"] = {"main": {"discovery": {"kubernetes": kubernetes}}}
    # Only the adapters are models of the file: "chat" exists only through the cluster's rule.
    data["models"] = {
        "chat-v1": {"pools": ["main"], "lora": True},
        "chat-v2": {"pools": ["main"], "lora": True},
    }
    stack.workdir.mkdir(parents=True, exist_ok=True)
    stack.config_path.write_text(yaml.safe_dump(data))
    config = parse_config(data, str(stack.config_path))
    seed_eds(eds_dir, config)
    stack.envoy_path.write_text(
        render(
            config,
            mode=mode,
            listen=f"127.0.0.1:{stack.envoy_port}",
            admin=f"127.0.0.1:{stack.admin_port}",
            extproc=[f"127.0.0.1:{p}" for p, _, _ in stack.epp_ports],
            health=[f"127.0.0.1:{h}" for _, h, _ in stack.epp_ports],
            eds_dir=str(eds_dir),
        )
    )


@pytest.fixture(scope="module", params=BODY_MODES)
def canary(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Canary]:
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"rewrite-{mode}")
    port = free_port()
    eds_dir = tmp / "eds"
    with FakeKube() as kube:
        kube.put("inferencepools", inference_pool("vllm-pool", APP, [port]))
        kube.put("pods", pod("a", IP, APP))
        kube.put(rewrites_kind(), model_rewrite("canary", "vllm-pool", SPLIT_90_10))
        stack = Stack(
            tmp / "stack",
            replicas=0,
            mode=mode,  # type: ignore[arg-type]
            epp_args=["--eds-dir", str(eds_dir)],
            config_extra={
                "routing": {"explain": True},
                "admission": {"mode": "off"},
                # The test is the gateway that sets the objective header.
                "request": {"trusted_headers": True},
            },
        )
        with stack:
            write_configs(stack, kube.url, eds_dir, mode)
            stack.spawn(
                f"sim-{IP}",
                [
                    sys.executable,
                    "-m",
                    "epp",
                    "sim",
                    "--host",
                    IP,
                    "--port",
                    str(port),
                    "--model",
                    "base",
                    "--lora-modules",
                    "chat-v1=/adapters/v1",
                    "chat-v2=/adapters/v2",
                    "--max-loras",
                    "2",
                    "--time-scale",
                    "0.001",
                ],
            )
            stack.start_epp(0)
            stack.start_envoy()
            wait_until(lambda: envoy_ready(stack), 20, "Envoy")
            wait_until(lambda: epp_ready_endpoints(stack) == {f"{IP}:{port}"}, 20, "the pod")
            fleet = Canary(stack, kube, mode)
            wait_until(lambda: fleet.ask()[0] == 200, 10, "the rewrite of chat to be known")
            yield fleet


def shares(models: list[str | None]) -> Counter[str | None]:
    return Counter(models)


def test_a_90_10_split_lands_within_two_points(canary: Canary) -> None:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: canary.ask(), range(REQUESTS)))
    assert {status for status, _ in answers} == {200}
    counts = shares([model for _, model in answers])
    share = counts["chat-v2"] / REQUESTS
    print(f"{canary.mode}: {dict(counts)} over {REQUESTS} requests, chat-v2 {share:.1%}")
    assert set(counts) == {"chat-v1", "chat-v2"}
    assert abs(share - 0.10) <= 0.02
    # The metrics name both: what the client asked for and where the rewrite sent it.
    url = f"http://127.0.0.1:{canary.stack.epp_ports[0][2]}/metrics"
    routed = metric_values(url, "inference_objective_request_total")
    assert routed['{model_name="chat",target_model_name="chat-v2"}'] >= counts["chat-v2"]


def test_a_session_stays_on_one_target(canary: Canary) -> None:
    sessions = [f"{canary.mode}-conversation-{i}" for i in range(100)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda s: (s, canary.ask(s)), sessions * 5))
    seen: dict[str, set[str | None]] = {}
    for session, (status, model) in answers:
        assert status == 200
        seen.setdefault(session, set()).add(model)
    assert all(len(models) == 1 for models in seen.values()), seen
    # The sessions themselves split between the two (about 10 of 100 on chat-v2).
    on = Counter(next(iter(models)) for models in seen.values())
    assert set(on) == {"chat-v1", "chat-v2"}, on


def test_new_weights_take_effect_with_one_watch_event(canary: Canary) -> None:
    epp = canary.stack.procs["epp0"]
    lists = canary.rewrite_lists()
    outcomes: list[tuple[float, int, str | None]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            started = time.monotonic()
            status, model = canary.ask()
            outcomes.append((started, status, model))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        took = {}
        for label, targets, expected in (
            ("100% v2", [("chat-v2", 1)], "chat-v2"),
            ("rollback to v1", [("chat-v1", 1)], "chat-v1"),
        ):
            changed = time.monotonic()
            canary.split_to(*targets)

            def settled(since: float = changed, model: str = expected) -> bool:
                recent = [m for t, _, m in outcomes if t > since][-20:]
                return len(recent) == 20 and set(recent) == {model}

            took[label] = wait_until(settled, 2, f"{label} to take effect")
            # From then on, every request goes there.
            applied = time.monotonic()
            time.sleep(0.3)
            assert {m for t, _, m in outcomes if t > applied} == {expected}
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        canary.kube.put(rewrites_kind(), model_rewrite("canary", "vllm-pool", SPLIT_90_10))
    print(
        f"{canary.mode}: {len(outcomes)} requests; "
        + ", ".join(f"{k} in {v * 1000:.0f} ms" for k, v in took.items())
    )
    assert [o for o in outcomes if o[1] != 200] == []
    # The watch carried the changes: no relist, and the same epp process served throughout.
    assert canary.rewrite_lists() == lists
    assert epp.popen.poll() is None
    assert epp.restarts == 0


def decision(canary: Canary, request_id: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{canary.stack.epp_ports[0][2]}/debug/decisions/{request_id}"
    with urllib.request.urlopen(url, timeout=2) as resp:
        found: dict[str, Any] = json.loads(resp.read())
    return found


def test_an_inference_objective_changes_the_band_live(canary: Canary) -> None:
    counter = iter(range(10**6))

    def priority() -> int:
        request_id = f"{canary.mode}-objective-{next(counter)}"
        status, _ = canary.ask(
            **{"x-gateway-inference-objective": "critical", "x-request-id": request_id}
        )
        assert status == 200
        return int(decision(canary, request_id)["priority"])

    assert priority() == 0  # no such objective yet: the default band
    kind = objectives_kind()
    try:
        canary.kube.put(kind, inference_objective("critical", "vllm-pool", 10))
        wait_until(lambda: priority() == 10, 2, "the objective's priority")
        canary.kube.put(kind, inference_objective("critical", "vllm-pool", -5))
        wait_until(lambda: priority() == -5, 2, "the objective's new priority")
    finally:
        canary.kube.delete(kind, "critical")
    wait_until(lambda: priority() == 0, 2, "the objective gone")


def test_the_answer_explains_the_rewrite(canary: Canary) -> None:
    reply = request(
        canary.stack.url,
        "/v1/completions",
        {"model": "chat", "prompt": "why", "max_tokens": 1},
        {"x-session-token": f"{canary.mode}-explained"},
    )
    assert reply.status == 200
    explained = json.loads(reply.headers["x-epp-scores"])["rewrite"]
    assert explained["model"] == "chat"
    assert explained["sticky"] is True
    assert explained["rule"] == "InferenceModelRewrite default/canary rules[0]"
    # The response names the model that ran: the target, as the engine returns it.
    assert reply.json()["model"] == explained["target"]
