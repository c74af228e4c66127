"""Fixtures for the real-vLLM contract tier.

Opt-in: the tier needs the vLLM venv (`bash tests/contract/setup_vllm.sh`, ~2.5 min and 2.5 GB
once) and costs ~20-40 s of startup plus ~2 GB RAM, so it runs only with EPP_CONTRACT=1:

    bash tests/contract/setup_vllm.sh
    EPP_CONTRACT=1 .venv/bin/pytest tests/contract -m contract

One server per session, started lazily by the first test that asks for `real_vllm`.  It is
started with LoRA enabled (adapter `tiny-lora`) and VLLM_SERVER_DEV_MODE=1 (for
`/reset_prefix_cache` -> AllBlocksCleared), so a single engine covers every contract; base-model
requests behave exactly as on a LoRA-less server (same block hashes, same counters).
test_priority_contract.py starts servers of its own (other scheduler flags) with
`vllm_server.start_vllm(extra_args=...)`. Every server's engine core runs at nice 19
(vllm_server.py says why: on two cores its spin-wait starved the API server, and tests that
sample /metrics while requests run saw too few samples once the box was busy).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_server import VENV, start_vllm, venv_ready


@dataclass(frozen=True)
class RealVllm:
    base_url: str  # e.g. http://127.0.0.1:41234 (OpenAI API, /metrics, /tokenize, /health)
    kv_events_endpoint: str  # tcp://127.0.0.1:PORT, ZMQ PUB; connect a SUB socket
    kv_topic: str  # first frame of every KV-event message
    block_size: int  # as reported by vllm:cache_config_info (32 on CPU)
    model: str  # served model name ("tiny")
    lora_name: str | None  # LoRA adapter served as its own model name ("tiny-lora")
    log_path: Path  # server log, handy in assertion messages


def skip_reason() -> str | None:
    if os.environ.get("EPP_CONTRACT") != "1":
        return "real-vLLM contract tier is opt-in: set EPP_CONTRACT=1"
    if not venv_ready():
        return (
            f"vLLM venv not found at {VENV}: run `bash tests/contract/setup_vllm.sh` "
            "(or set EPP_VLLM_VENV)"
        )
    return None


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[RealVllm]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with start_vllm(lora=True, dev_mode=True, engine_nice=19) as srv:
        yield RealVllm(
            base_url=srv.base_url,
            kv_events_endpoint=srv.kv_events_endpoint,
            kv_topic=srv.kv_topic,
            block_size=srv.block_size,
            model=srv.model,
            lora_name=srv.lora_name,
            log_path=srv.log_path,
        )
