"""End to end against a simulated vLLM replica in its own process (``epp sim``).

The replica tokenizes and caches like vLLM (chat template, BOS, LoRA extra keys, only full
blocks) and publishes real ZMQ KV events. After it serves a prompt, the index built from its
events must hold exactly the keys that our tokenizer path computes for the same request: this
proves tokenization and chaining agree with what the engine stored.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from epp.devstack import free_port
from epp.prefix.precise import PRECISE_INDEX, TOKENIZERS, chain_keys, root_key
from epp.request import RequestPolicy, parse_request
from epp.scheduling import Cycle
from epp.scheduling.prefix_data import best_cached_tokens
from epp.scheduling.scorers.precise_prefix import PrecisePrefixCacheScorer
from epp.sim.tokenization import BUNDLED_DIR
from epp.sources.kv_events import KvEventSubscriber
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState

pytest.importorskip("jinja2")

BLOCK_SIZE = 16
LORA = "tiny-lora"
ENDPOINT = "sim"


@dataclass(frozen=True)
class Sim:
    base_url: str
    kv_events: str


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    port, kv_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "epp", "sim", "--port", str(port)),
            *("--kv-events-endpoint", f"tcp://*:{kv_port}", "--block-size", str(BLOCK_SIZE)),
            *("--time-scale", "0.01", "--lora-modules", f"{LORA}=/nonexistent/{LORA}"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "simulator did not become healthy"
                time.sleep(0.1)
        yield Sim(base_url, f"tcp://127.0.0.1:{kv_port}")
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def fleet(sim: Sim) -> AsyncIterator[FleetState]:
    """A fleet whose index follows the simulator's events, connected before the test starts."""
    fleet = FleetState()
    fleet.states.get(TOKENIZERS).set_models({"tiny": str(BUNDLED_DIR), LORA: str(BUNDLED_DIR)})
    subscriber = KvEventSubscriber(fleet.states.get(PRECISE_INDEX))
    subscriber.set_endpoints({ENDPOINT: sim.kv_events})
    await subscriber.start()
    try:
        async with aiohttp.ClientSession() as session:
            # ZMQ slow joiner: messages sent before the subscription propagates are lost.
            deadline = time.monotonic() + 10
            while fleet.states.get(PRECISE_INDEX).block_count(ENDPOINT) == 0:
                assert time.monotonic() < deadline, "no KV events from the simulator"
                body = {"model": "tiny", "prompt": list(range(5, 5 + BLOCK_SIZE)), "max_tokens": 1}
                await post(session, sim, "/v1/completions", body)
                await asyncio.sleep(0.1)
        yield fleet
    finally:
        await subscriber.stop()


async def post(session: aiohttp.ClientSession, sim: Sim, path: str, body: object) -> None:
    async with session.post(sim.base_url + path, json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()


CASES = {
    "completion": ("/v1/completions", "tiny", None),
    "chat": ("/v1/chat/completions", "tiny", None),
    "lora-completion": ("/v1/completions", LORA, LORA),
    "lora-chat": ("/v1/chat/completions", LORA, LORA),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_engine_blocks_match_our_keys_for_the_same_request(
    sim: Sim, fleet: FleetState, case: str
) -> None:
    path, model, lora = CASES[case]
    nonce = f"{case} {time.time_ns()}"
    text = f"Request {nonce}. " + "Shared context about routing and prefix caches. " * 12
    if path.endswith("chat/completions"):
        body: dict[str, object] = {
            "model": model,
            "messages": [
                {"role": "system", "content": f"You are assistant {nonce}."},
                {"role": "user", "content": text},
            ],
        }
    else:
        body = {"model": model, "prompt": text}
    body["max_tokens"] = 1
    request = parse_request(path, {}, json.dumps(body).encode(), RequestPolicy())
    request.lora = lora  # the router sets it from models.<name>.lora
    tokens = fleet.states.get(TOKENIZERS).token_ids(request)
    assert tokens is not None
    keys = chain_keys(tokens, BLOCK_SIZE, root_key(lora))
    assert len(keys) >= 8
    index = fleet.states.get(PRECISE_INDEX)
    assert index.match(keys, [ENDPOINT], time.time()) == {ENDPOINT: 0}

    async with aiohttp.ClientSession() as session:
        await post(session, sim, path, body)
    deadline = time.monotonic() + 5
    while index.match(keys, [ENDPOINT], time.time())[ENDPOINT] < len(keys):
        assert time.monotonic() < deadline, (
            f"engine blocks never matched our keys: "
            f"{index.match(keys, [ENDPOINT], time.time())} of {len(keys)}"
        )
        await asyncio.sleep(0.02)

    endpoint = EndpointState(ENDPOINT, "pool", True, EndpointMetrics(block_size=BLOCK_SIZE))
    cycle = Cycle(Snapshot(), fleet)
    scorer = PrecisePrefixCacheScorer()
    scorer.produce(request, [endpoint], cycle)
    assert scorer.score(request, [endpoint], cycle) == [1.0]
    usable = (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert best_cached_tokens(cycle) == {ENDPOINT: min(len(keys) * BLOCK_SIZE, usable)}
