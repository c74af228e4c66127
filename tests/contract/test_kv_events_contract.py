"""Precise prefix contract with a real vLLM (EPP_CONTRACT=1 only).

Our KV-event subscriber and index, fed by the real engine, must hold exactly the keys that our
tokenizer path computes for the same request: a completion (BOS added by the tokenizer's
post-processor), a chat request (vLLM's chat template rendering, no extra BOS) and a LoRA
request (blocks keyed under the adapter). The tiny model uses the repo's tokenizer
(``epp/sim/tokenizer``), which is what epp is configured with here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from conftest import RealVllm

from epp.prefix.precise import PRECISE_INDEX, TOKENIZERS, chain_keys, root_key
from epp.request import RequestPolicy, parse_request
from epp.scheduling import Cycle
from epp.scheduling.scorers.precise_prefix import PrecisePrefixCacheScorer
from epp.sim.tokenization import BUNDLED_DIR
from epp.sources.kv_events import KvEventSubscriber
from epp.state import EndpointMetrics, EndpointState, Snapshot
from epp.state.fleet import FleetState

pytestmark = pytest.mark.contract
ENDPOINT = "vllm"


async def post(session: aiohttp.ClientSession, url: str, body: object) -> None:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()


@pytest.fixture
async def fleet(real_vllm: RealVllm) -> AsyncIterator[FleetState]:
    pytest.importorskip("jinja2")
    fleet = FleetState()
    models = {real_vllm.model: str(BUNDLED_DIR)}
    if real_vllm.lora_name:
        models[real_vllm.lora_name] = str(BUNDLED_DIR)
    fleet.states.get(TOKENIZERS).set_models(models)
    subscriber = KvEventSubscriber(fleet.states.get(PRECISE_INDEX), topic=real_vllm.kv_topic)
    subscriber.set_endpoints({ENDPOINT: real_vllm.kv_events_endpoint})
    await subscriber.start()
    try:
        async with aiohttp.ClientSession() as session:
            # ZMQ slow joiner: resend a one-block prompt until its event arrives.
            deadline = time.monotonic() + 20
            while fleet.states.get(PRECISE_INDEX).block_count(ENDPOINT) == 0:
                assert time.monotonic() < deadline, "no KV events from vLLM"
                seed = time.time_ns() % 1000
                prompt = [5 + (seed + i * 7) % 4000 for i in range(real_vllm.block_size)]
                body = {"model": real_vllm.model, "prompt": prompt, "max_tokens": 1}
                await post(session, real_vllm.base_url + "/v1/completions", body)
                await asyncio.sleep(0.2)
        yield fleet
    finally:
        await subscriber.stop()


@pytest.mark.parametrize("case", ["completion", "chat", "lora-completion"])
async def test_real_engine_blocks_match_our_keys(
    real_vllm: RealVllm, fleet: FleetState, case: str
) -> None:
    lora = real_vllm.lora_name if case.startswith("lora") else None
    if case.startswith("lora") and lora is None:
        pytest.skip("the server has no LoRA adapter")
    model = lora or real_vllm.model
    nonce = f"{case} {time.time_ns()}"
    text = f"Request {nonce}. " + "Shared context about routing and prefix caches. " * 16
    if case == "chat":
        path = "/v1/chat/completions"
        body: dict[str, object] = {
            "model": model,
            "messages": [
                {"role": "system", "content": f"You are assistant {nonce}."},
                {"role": "user", "content": text},
            ],
        }
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": text}
    body.update(max_tokens=1, temperature=0)
    request = parse_request(path, {}, json.dumps(body).encode(), RequestPolicy())
    request.lora = lora
    tokens = fleet.states.get(TOKENIZERS).token_ids(request)
    assert tokens is not None
    size = real_vllm.block_size
    keys = chain_keys(tokens, size, root_key(lora))
    assert len(keys) >= 4
    index = fleet.states.get(PRECISE_INDEX)
    assert index.match(keys, [ENDPOINT], time.time()) == {ENDPOINT: 0}

    async with aiohttp.ClientSession() as session:
        await post(session, real_vllm.base_url + path, body)
    deadline = time.monotonic() + 10
    while (found := index.match(keys, [ENDPOINT], time.time())[ENDPOINT]) < len(keys):
        assert time.monotonic() < deadline, (
            f"{found} of {len(keys)} blocks matched; server log: {real_vllm.log_path}"
        )
        await asyncio.sleep(0.05)

    endpoint = EndpointState(ENDPOINT, "pool", True, EndpointMetrics(block_size=size))
    cycle = Cycle(Snapshot(), fleet)
    scorer = PrecisePrefixCacheScorer()
    scorer.produce(request, [endpoint], cycle)
    assert scorer.score(request, [endpoint], cycle) == [1.0]
