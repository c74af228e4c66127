"""End-to-end fixtures: a real Envoy, real epp processes and simulated vLLM replicas."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.devstack import Stack, free_port

REDIS_URL = os.environ.get("EPP_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def make_stack(tmp: Path, mode: str, store: str, **kwargs: object) -> Stack:
    extra = dict(kwargs.pop("config_extra", {}) or {})  # type: ignore[arg-type]
    redis_url = None
    if store == "redis":
        redis_url = REDIS_URL
        extra["store"] = {"key_prefix": f"epp-test-{uuid.uuid4().hex[:8]}"}
    return Stack(tmp, mode=mode, redis_url=redis_url, config_extra=extra, **kwargs)  # type: ignore[arg-type]


BODY_MODES = [
    pytest.param("buffered", id="buffered"),
    pytest.param("full-duplex", id="fullduplex"),
]


def serve_stack(
    tmp_path_factory: pytest.TempPathFactory, name: str, mode: str, **kwargs: object
) -> Iterator[Stack]:
    """A started in-memory stack in ``mode`` for a module-scoped fixture to yield from."""
    s = make_stack(tmp_path_factory.mktemp(f"{name}-{mode}"), mode, "memory", **kwargs)
    s.start()
    try:
        yield s
    finally:
        s.stop()


VARIANTS = [
    pytest.param(("buffered", "memory"), id="buffered-memory"),
    pytest.param(("full-duplex", "memory"), id="fullduplex-memory"),
    pytest.param(("buffered", "redis"), id="buffered-redis"),
    pytest.param(("full-duplex", "redis"), id="fullduplex-redis"),
]


@pytest.fixture(scope="module", params=VARIANTS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A shared healthy stack per variant, for tests that leave it as they found it."""
    mode, store = request.param
    s = make_stack(
        tmp_path_factory.mktemp(f"{mode}-{store}"),
        mode,
        store,
        config_extra={
            "routing": {"max_body_bytes": 4 * 1024 * 1024},
            # A second pool whose only endpoint never answers: 503s and model aggregation.
            "models": {"ghost": {"pools": ["ghost"]}},
            "pools": {"ghost": {"endpoints": [f"127.0.0.1:{free_port()}"]}},
        },
        # Room for the 2 MB prompt (about 1.2M tokens of this tokenizer) in one replica.
        sim_args=[
            "--max-model-len",
            "2000000",
            "--num-gpu-blocks",
            "130000",
            "--time-scale",
            "0.01",
        ],
    )
    s.start()
    yield s
    s.stop()
