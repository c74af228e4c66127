"""What the fuzz tests share: hypothesis settings, the seed corpus and a real router.

``make test`` runs a fixed, derandomized budget (the seed corpus, the ``@example`` cases and
``FAST_EXAMPLES`` generated ones: a few seconds). ``EPP_FUZZ_EXAMPLES=1500`` (``.ci/run``)
explores ten times more inputs, still derandomized so that CI never fails by chance: a
finding there reproduces on every run. ``EPP_FUZZ_RANDOM=1`` draws fresh inputs each run, for
exploring by hand; docs/fuzzing.md records what was found.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from hypothesis import HealthCheck, settings

from epp.config import parse_config
from epp.router import Router
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore

FAST_EXAMPLES = 150
EXAMPLES = int(os.environ.get("EPP_FUZZ_EXAMPLES", FAST_EXAMPLES))
RANDOM = os.environ.get("EPP_FUZZ_RANDOM") == "1"

FUZZ = settings(
    max_examples=EXAMPLES,
    # The same inputs every run unless asked: a failure in make test or CI reproduces exactly.
    derandomize=not RANDOM,
    # Each example is a pure computation; a slow one is a finding, reported by the timing
    # assertion of the test that cares (hypothesis' own deadline flakes on a busy machine).
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

CORPUS = Path(__file__).resolve().parents[2] / "fuzz" / "corpus"
LIMIT = 64 * 1024  # routing.max_body_bytes of the fuzzed router
ENDPOINTS = ("127.0.0.1:8001", "127.0.0.1:8002")


def corpus() -> list[tuple[str, bytes]]:
    """Every seed input: (file name, bytes). Names start with the API path they target."""
    return sorted((p.name, p.read_bytes()) for p in CORPUS.iterdir() if p.is_file())


def path_of(name: str) -> str:
    """The request path a corpus file is meant for (``chat--x.json`` -> chat completions)."""
    return {
        "chat": "/v1/chat/completions",
        "responses": "/v1/responses",
        "embeddings": "/v1/embeddings",
    }.get(name.split("--", 1)[0], "/v1/completions")


def make_router() -> Router:
    config = parse_config(
        {
            "models": {"tiny": {"pools": ["main"]}, "other": {"pools": ["main"]}},
            "pools": {"main": {"endpoints": list(ENDPOINTS)}},
            "routing": {"fallbacks": 1, "max_body_bytes": LIMIT, "inject_stream_usage": True},
        }
    )
    store = MemoryStore()

    async def fill() -> None:
        for address in ENDPOINTS:
            await store.put_endpoint(
                EndpointState(address, "main", True, EndpointMetrics(waiting=1), 1.0)
            )

    asyncio.run(fill())
    return Router(config, FleetState(store))
