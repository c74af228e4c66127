"""A model rewrite with a weighted split, reaching a real vLLM that serves a LoRA adapter
(EPP_CONTRACT=1 only).

Clients ask for ``chat``; epp's configuration splits it 50/50 between the base model ``tiny``
and the adapter ``tiny-lora`` (docs/rewrite.md), through a real Envoy, to the contract tier's
vLLM (conftest.py: LoRA enabled, the adapter served under its own name). The engine shows what
it ran twice over: its answer names the model it served, and the KV blocks it publishes for
the request's prompt (its KV events) carry the adapter's name, or none for the base model.
(The answers' tokens cannot tell: the tiny random model's output is flat, and the random
adapter does not move its argmax or its logprobs at float32 precision.) Over 40 requests both
targets serve a share near half; a session stays on one target; epp counts each request under
``model_name="chat"`` and the target it chose.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from conftest import RealVllm
from engine_stack import EngineStack, counter, engine_stack

from epp.sources.kv_events import BlockStored, decode_message
from tests.e2e.client import request

pytestmark = pytest.mark.contract

REQUESTS = 40


@pytest.fixture(scope="module")
def stack(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineStack]:
    assert real_vllm.lora_name is not None
    models: dict[str, Any] = {
        "chat": {"rewrite": [{"model": real_vllm.model}, {"model": real_vllm.lora_name}]},
        real_vllm.lora_name: {"pools": ["main"], "lora": True},
    }
    address = real_vllm.base_url.removeprefix("http://")
    stack = engine_stack(tmp_path_factory.mktemp("rewrite-contract"), [address], {"models": models})
    with stack:
        stack.start()
        yield stack


@pytest.fixture
def kv_events(real_vllm: RealVllm) -> Iterator[zmq.Socket[bytes]]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, real_vllm.kv_topic.encode())
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(real_vllm.kv_events_endpoint)
    time.sleep(0.5)  # ZMQ slow joiner: the subscription reaches the publisher
    try:
        yield sub
    finally:
        sub.close(linger=0)


def prompt(block_size: int) -> list[int]:
    """One whole block and a few tokens, drawn at random: no earlier prompt of the run starts
    with its block (a cached block would publish no event)."""
    return random.sample(range(5, 3000), block_size + 4)


def complete(base: str, ids: list[int], headers: dict[str, str] | None = None) -> str:
    """The model the engine names in its answer."""
    body = {"model": "chat", "prompt": ids, "max_tokens": 2, "temperature": 0}
    reply = request(base, "/v1/completions", body, headers, timeout=60)
    assert reply.status == 200, reply.body[:300]
    model: str = reply.json()["model"]
    return model


def adapter_of(sub: zmq.Socket[bytes], first_block: list[int]) -> str | None:
    """The adapter the engine computed the block of ``first_block`` under (None: base)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            continue
        for event in decode_message(frames).events:
            if (
                isinstance(event, BlockStored)
                and event.token_ids[: len(first_block)] == first_block
            ):
                return event.lora_name
    raise AssertionError("the engine published no block of the prompt within 10 s")


def routed(stack: EngineStack, target: str) -> float:
    url = f"http://127.0.0.1:{stack.epp_ports[0][2]}"
    return counter(
        url, "inference_objective_request_total", model_name="chat", target_model_name=target
    )


def test_a_weighted_split_reaches_the_engine_as_the_target_model(
    real_vllm: RealVllm, stack: EngineStack, kv_events: zmq.Socket[bytes]
) -> None:
    assert real_vllm.lora_name is not None
    targets = (real_vllm.model, real_vllm.lora_name)
    before = {t: routed(stack, t) for t in targets}
    served: Counter[str] = Counter()
    size = real_vllm.block_size
    for _ in range(REQUESTS):
        ids = prompt(size)
        model = complete(stack.url, ids)
        assert model in targets
        adapter = adapter_of(kv_events, ids[:size])
        assert adapter == (real_vllm.lora_name if model == real_vllm.lora_name else None)
        served[model] += 1
    # Binomial(40, 1/2): outside [8, 32] about once in 25,000 runs.
    assert all(8 <= served[t] <= 32 for t in targets), served
    assert {t: routed(stack, t) - before[t] for t in targets} == served


def test_a_session_stays_on_one_target(real_vllm: RealVllm, stack: EngineStack) -> None:
    ids = prompt(real_vllm.block_size)
    for session in ("alice", "bob", "carol"):
        seen = {complete(stack.url, ids, {"x-session-token": session}) for _ in range(5)}
        assert len(seen) == 1, (session, seen)
