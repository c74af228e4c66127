"""The grpc.aio servicer over real gRPC: preparation is awaited between parse and route."""

from __future__ import annotations

import json
import random

import grpc

from epp._proto import ext_proc_pb2, ext_proc_pb2_grpc
from epp.config import parse_config
from epp.extproc.servicer import ExtProcServicer
from epp.prefix.precise import PRECISE_INDEX, TOKENIZERS
from epp.prefix.tokens import TokenizerRegistry
from epp.request import InferenceRequest
from epp.sim.tokenization import BUNDLED_DIR
from tests.unit.test_stream import FULL_DUPLEX, body_msg, destination, headers_msg, make_router

PROFILE = {
    "profile": "precise",
    "profiles": {
        "precise": [
            # The wait for the worker thread's ids is bounded (0.1 s by default); past it the
            # request is scored without them, which this test would see as a tie. A busy
            # machine tokenizes the 20,000-character prompt slower than that, so no bound a
            # test could reach.
            {
                "plugin": "precise-prefix-cache-scorer",
                "parameters": {"max_inline_chars": 1000, "tokenize_wait": 3600},
            },
            {"plugin": "max-score-picker"},
        ]
    },
}


async def test_a_long_new_prompt_is_tokenized_before_it_is_routed() -> None:
    """Repeated with fresh routers: a tie broken at random would pass about 1 time in 2^5."""
    for _ in range(5):
        await _route_once()


async def _route_once() -> None:
    router = await make_router()
    router.config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"], "tokenizer": str(BUNDLED_DIR)}},
            "pools": {"main": {"endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}},
            "routing": {"max_body_bytes": 10**6},
            "scheduling": PROFILE,
        }
    )
    router.fleet.states.get(TOKENIZERS).set_models({"tiny": str(BUNDLED_DIR)})
    rng = random.Random(1)
    prompt = " ".join(rng.choice(("alpha", "beta", "gamma")) for _ in range(4000))
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
    # The engine behind 8001 caches the prompt's first 8 blocks (a separate registry computes
    # the ids, so the router's cache has never seen the prompt). Only a request scored with its
    # ids can see that; without them the two endpoints tie and either may win.
    reference = TokenizerRegistry()
    reference.set_models({"tiny": str(BUNDLED_DIR)})
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", prompt)
    ids = reference.token_ids(request, max_inline_chars=10**9)
    assert ids is not None
    hashes = [hash(("8001", i)) & (2**64 - 1) for i in range(8)]
    router.fleet.states.get(PRECISE_INDEX).stored(
        "127.0.0.1:8001", hashes, None, tuple(ids[: 8 * 16]), 16
    )

    server = grpc.aio.server()
    ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(router), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ext_proc_pb2_grpc.ExternalProcessorStub(channel)
            call = stub.Process(iter([headers_msg(mode=FULL_DUPLEX), body_msg(body)]))
            answers: list[ext_proc_pb2.ProcessingResponse] = [a async for a in call]
    finally:
        await server.stop(None)
    header, meta = destination(answers[0], "request_headers")
    assert header == meta
    assert header.startswith("127.0.0.1:8001,")
