"""The server feeds the precise prefix scorer: tokenizers and KV-event subscriptions follow
configuration reloads."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import yaml
import zmq
import zmq.asyncio

from epp.config import load_config
from epp.prefix.precise import PRECISE_INDEX, TOKENIZERS
from epp.request import InferenceRequest
from epp.server import Server
from epp.sim.tokenization import BUNDLED_DIR
from tests.unit.prefix.helpers import message, stored

ENDPOINT = "127.0.0.1:8000"


def write_config(path: Path, kv_events: str | None) -> None:
    endpoint: dict[str, object] = {"address": ENDPOINT}
    model: dict[str, object] = {"pools": ["p"]}
    if kv_events is not None:
        endpoint["kv_events"] = kv_events
        model["tokenizer"] = str(BUNDLED_DIR)
    path.write_text(
        yaml.safe_dump({"models": {"tiny": model}, "pools": {"p": {"endpoints": [endpoint]}}})
    )


async def test_reload_subscribes_to_new_kv_event_publishers_and_loads_tokenizers(
    tmp_path: Path,
) -> None:
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    path = tmp_path / "epp.yaml"
    write_config(path, None)
    server = Server(path, load_config(path))
    fleet = server.fleet
    request = InferenceRequest("r", "/v1/completions", "completions", "tiny", "hello")
    await server.kv_events.start()
    try:
        assert fleet.states.get(TOKENIZERS).token_ids(request) is None
        write_config(path, f"tcp://127.0.0.1:{port}")
        assert await server.reload()
        assert fleet.states.get(TOKENIZERS).token_ids(request) is not None
        deadline = time.monotonic() + 5
        seq = 0
        while fleet.states.get(PRECISE_INDEX).block_count(ENDPOINT) == 0:
            assert time.monotonic() < deadline, "the reloaded config's publisher was not subscribed"
            await pub.send_multipart(message(seq, stored([1], [5, 6, 7, 8])))
            seq += 1
            await asyncio.sleep(0.05)
        write_config(path, None)
        assert await server.reload()
        assert fleet.states.get(PRECISE_INDEX).block_count(ENDPOINT) == 0
    finally:
        await server.kv_events.stop()
        pub.close(linger=0)
