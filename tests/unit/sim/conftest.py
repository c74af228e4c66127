"""Shared fixtures: small engines and in-process replicas on real 127.0.0.1 ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest

from epp.devstack import free_port
from epp.sim.engine import EngineConfig
from epp.sim.profiles import PROFILES
from epp.sim.replica import Replica, ReplicaConfig
from epp.sim.tokenization import BUNDLED_DIR, SimTokenizer


@pytest.fixture(scope="session")
def tokenizer() -> SimTokenizer:
    return SimTokenizer(BUNDLED_DIR)


def engine_config(**overrides: Any) -> EngineConfig:
    base = EngineConfig(
        profile=PROFILES["cpu-tiny"],
        block_size=4,
        num_gpu_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        max_model_len=200,
        time_scale=0.01,
    )
    return replace(base, **overrides)


ReplicaFactory = Callable[..., Any]


@pytest.fixture
async def start_replica(tokenizer: SimTokenizer) -> AsyncIterator[ReplicaFactory]:
    """Start replicas with given config overrides; all are stopped at teardown."""
    started: list[Replica] = []

    async def start(engine: EngineConfig | None = None, **overrides: Any) -> Replica:
        config = ReplicaConfig(
            host="127.0.0.1",
            port=free_port(),
            model="tiny",
            engine=engine or engine_config(),
            **overrides,
        )
        replica = Replica(config, tokenizer)
        await replica.start()
        started.append(replica)
        return replica

    yield start
    for r in started:
        await r.stop()
