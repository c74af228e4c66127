"""Smoke test of the real-vLLM fixture itself (EPP_CONTRACT=1 only).

Proves the tier is wired: the server answers, reports the block size we rely on, serves the
LoRA adapter, and publishes a decodable KV-event batch for a request.
"""

from __future__ import annotations

import json
import time
import urllib.request

import msgpack
import pytest
import zmq
from conftest import RealVllm

pytestmark = pytest.mark.contract


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_models_and_block_size(real_vllm: RealVllm) -> None:
    with urllib.request.urlopen(real_vllm.base_url + "/v1/models", timeout=10) as r:
        ids = [m["id"] for m in json.loads(r.read())["data"]]
    assert real_vllm.model in ids
    assert real_vllm.lora_name in ids
    assert real_vllm.block_size % 32 == 0  # CPU backend constraint


def test_kv_events_for_a_request(real_vllm: RealVllm) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, real_vllm.kv_topic.encode())
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(real_vllm.kv_events_endpoint)
    try:
        time.sleep(0.5)  # ZMQ slow joiner
        # A fresh random-ish prompt of exactly 2 full blocks (token ids: no BOS is added).
        seed = time.time_ns() % 1000
        prompt = [5 + (seed + i * 7) % 4000 for i in range(2 * real_vllm.block_size)]
        _post(
            real_vllm.base_url + "/v1/completions",
            {"model": real_vllm.model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        )
        deadline = time.monotonic() + 10
        stored: list[dict[str, object]] = []
        while time.monotonic() < deadline and not stored:
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.Again:
                continue
            assert topic == real_vllm.kv_topic.encode()
            assert len(seq) == 8
            ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
            assert isinstance(ts, float)
            assert dp_rank == 0
            stored += [e for e in events if e["type"] == "BlockStored"]
        assert stored, "no BlockStored event within 10 s"
        assert stored[0]["block_size"] == real_vllm.block_size
    finally:
        sub.close(linger=0)
