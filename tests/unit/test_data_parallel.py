"""Data-parallel ranks as endpoints: configuration, expansion, per-rank metrics and KV events,
the pick's answer."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from prometheus_client import REGISTRY

from epp.config import Config, ConfigError, parse_config
from epp.data_parallel import MAX_RANKS, Rank, offset_events_address, rank_address, rank_changes
from epp.extproc.stream import StreamHandler
from epp.prefix.precise import PreciseIndex
from epp.router import Router
from epp.sources.kv_events import KvEventSubscriber, decode_message
from epp.sources.scraper import MetricsScraper
from epp.sources.sglang_metrics import parse_sglang_metrics
from epp.sources.vllm_metrics import parse_vllm_metrics
from epp.state import EndpointMetrics, EndpointState
from epp.state.fleet import FleetState
from epp.state.memory import MemoryStore
from epp.wire import SERVED
from tests.unit.conftest import eventually
from tests.unit.prefix.helpers import message, stored
from tests.unit.test_response_stream import _response_headers
from tests.unit.test_scraper import FakeVllm, _ready
from tests.unit.test_stream import BODY, body_msg, destination, headers_msg


def with_ranks(config: Config) -> Config:
    """What the server routes with: the configuration with its ranks."""
    return dataclasses.replace(config, **rank_changes(config))


def _config(data_parallel: dict[str, Any] | None, **endpoint: Any) -> Any:
    pool: dict[str, Any] = {
        "endpoints": [
            {"address": "10.0.0.5:8000", **endpoint},
            "10.0.0.6:8000",
        ]
    }
    if data_parallel is not None:
        pool["data_parallel"] = data_parallel
    return parse_config({"models": {"m": {"pools": ["dp"]}}, "pools": {"dp": pool}})


# -- configuration and expansion ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"size": 0}, "size"),
        ({"size": MAX_RANKS + 1}, "size"),
        ({"size": True}, "size"),
        ({"size": 2, "header": "x-anything"}, "header"),
        ({"size": 2, "ranks": 3}, "ranks: must be one of the known keys"),
        ([2], "mapping"),
    ],
)
def test_bad_sections_are_refused_with_the_key(section: Any, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(section)
    assert "data_parallel" in str(err.value)
    assert words in str(err.value)


def test_each_replica_becomes_one_endpoint_per_rank_named_as_llm_d_names_them() -> None:
    config = with_ranks(
        _config({"size": 2}, weight=2.0, kv_events="tcp://10.0.0.5:5557", role="decode")
    )
    assert config.pools["dp"] == (
        "10.0.0.5:8000",
        "10.0.0.5:8001",
        "10.0.0.6:8000",
        "10.0.0.6:8001",
    )
    assert config.ranks["10.0.0.5:8001"] == Rank("10.0.0.5:8000", 1)
    assert config.ranks["10.0.0.6:8000"] == Rank("10.0.0.6:8000", 0)
    # A rank inherits its replica's weight and role; its KV events come from port + rank.
    assert config.weights["10.0.0.5:8001"] == 2.0
    assert config.roles["10.0.0.5:8001"] == config.roles["10.0.0.5:8000"]
    assert config.kv_events["10.0.0.5:8001"] == "tcp://10.0.0.5:5558"
    assert config.kv_events["10.0.0.5:8000"] == "tcp://10.0.0.5:5557"
    assert config.endpoints_for_model("m") == config.pools["dp"]
    # Applying it again (the server does on every membership change) changes nothing.
    assert with_ranks(config) == config


def test_a_rank_whose_name_is_taken_is_left_out() -> None:
    config = parse_config(
        {
            "models": {"m": {"pools": ["dp"]}},
            "pools": {
                "dp": {
                    "endpoints": ["10.0.0.5:8000", "10.0.0.5:8002", "10.0.0.7:65535"],
                    "data_parallel": {"size": 3},
                }
            },
        }
    )
    pools = with_ranks(config).pools["dp"]
    # 8000's rank 2 would be 8002, a replica; 8002's rank 1 (8003) is free; 65535 has no rank 1.
    assert pools == ("10.0.0.5:8000", "10.0.0.5:8001", "10.0.0.5:8002", "10.0.0.5:8003",
                     "10.0.0.5:8004", "10.0.0.7:65535")  # fmt: skip


def test_names_and_event_addresses_follow_vllm_and_llm_d() -> None:
    assert rank_address("[fd00::1]:8000", 3) == "[fd00::1]:8003"
    assert rank_address("10.0.0.1:65535", 1) is None
    assert offset_events_address("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_events_address("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert Rank("10.0.0.1:8000", 1, "x-data-parallel-rank").header_value("10.0.0.1:8001") == "1"
    assert Rank("10.0.0.1:8000", 1).header_value("10.0.0.1:8001") == "10.0.0.1:8001"


# -- per-rank metrics ---------------------------------------------------------------------------

# Two engines of one server, as vLLM labels them (model_name, engine).
VLLM_PAGE = (
    "\n".join(
        f'vllm:{name}{{model_name="m",engine="{engine}"}} {value}'
        for name, by_engine in (
            ("num_requests_running", (2, 3)),
            ("num_requests_waiting", (0, 4)),
            ("kv_cache_usage_perc", (0.25, 0.75)),
            ("prefix_cache_queries_total", (100, 50)),
        )
        for engine, value in enumerate(by_engine)
    )
    + "".join(
        f'\nvllm:cache_config_info{{block_size="32",engine="{engine}",num_gpu_blocks="{n}"}} 1.0'
        for engine, n in ((0, 100), (1, 120))
    )
    + '\nvllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 2'
)


def test_vllm_page_is_read_per_engine_label() -> None:
    zero, one = parse_vllm_metrics(VLLM_PAGE, 0), parse_vllm_metrics(VLLM_PAGE, 1)
    assert (zero.running, zero.waiting, zero.kv_usage) == (2, 0, 0.25)
    assert (one.running, one.waiting, one.kv_usage) == (3, 4, 0.75)
    assert (zero.num_gpu_blocks, one.num_gpu_blocks) == (100, 120)
    assert (zero.prefix_cache_queries, one.prefix_cache_queries) == (100.0, 50.0)
    # A series without an engine label is the process's: every rank sees it.
    assert zero.running_loras == one.running_loras == {"a"}
    with pytest.raises(ValueError, match='engine="2"'):
        parse_vllm_metrics(VLLM_PAGE, 2)


def test_sglang_page_is_read_per_dp_rank() -> None:
    page = "\n".join(
        f'sglang:{name}{{dp_rank="{rank}",tp_rank="{tp}",moe_ep_rank="0",pp_rank="0"}} {value}'
        for name, rank, value in (("num_running_reqs", 0, 1), ("num_running_reqs", 1, 5),
                                  ("num_queue_reqs", 0, 2), ("num_queue_reqs", 1, 0),
                                  ("token_usage", 0, 0.5), ("token_usage", 1, 0.125))
        for tp in (0, 1)
    ) + '\nsglang:prompt_tokens_total{model_name="m"} 100'  # fmt: skip
    zero, one = parse_sglang_metrics(page, 0), parse_sglang_metrics(page, 1)
    assert (zero.running, zero.waiting, zero.kv_usage) == (1, 2, 0.5)
    assert (one.running, one.waiting, one.kv_usage) == (5, 0, 0.125)
    assert zero.prefix_cache_queries == 0.0  # the tokenizer's counters name no rank
    assert parse_sglang_metrics(page).running == 6
    with pytest.raises(ValueError, match="num_running_reqs"):
        parse_sglang_metrics(page, 3)


async def test_scraper_reads_each_rank_from_its_replicas_page() -> None:
    server = FakeVllm()
    server.page = VLLM_PAGE
    await server.start()
    store = MemoryStore()
    scraper = MetricsScraper(store, interval=0.02)
    host = server.address.rpartition(":")[0]
    rank1 = f"{host}:{server.port + 1}"  # nothing listens there: the replica's page is read
    scraper.set_ranks({server.address: (server.address, 0), rank1: (server.address, 1)})
    scraper.set_endpoints({server.address: "dp", rank1: "dp"})
    await scraper.start()
    try:

        def both_ready() -> bool:
            states = store.snapshot()
            return all(
                (s := states.get(a)) is not None and s.ready for a in (server.address, rank1)
            )

        await eventually(both_ready, what="both ranks ready")
        zero, one = (store.snapshot().get(a) for a in (server.address, rank1))
        assert zero is not None
        assert one is not None
        assert (zero.metrics.waiting, one.metrics.waiting) == (0, 4)
        # The replica dropped to one rank: rank 1's scrapes fail, rank 0 stays ready.
        server.page = VLLM_PAGE.replace('engine="1"', 'engine="0"')
        await eventually(lambda: not _ready(store, rank1), what="rank 1 unready")
        assert _ready(store, server.address)
    finally:
        await scraper.stop()
        await server.stop()


# -- per-rank KV events -------------------------------------------------------------------------


def _resets(endpoint: str, reason: str) -> float:
    labels = {"endpoint": endpoint, "reason": reason}
    return REGISTRY.get_sample_value("epp_kv_index_resets_total", labels) or 0.0


def test_kv_batches_carry_their_rank_and_another_ranks_batch_is_not_applied() -> None:
    def batch(seq: int, rank: int | None) -> list[bytes]:
        return message(seq, payload=[1.0, [stored([seq + 1], list(range(4)))], rank])

    assert decode_message(batch(0, 1)).rank == 1
    assert decode_message(batch(0, None)).rank is None
    index = PreciseIndex()
    sub = KvEventSubscriber(index)
    sub.set_endpoints({"r1": "tcp://127.0.0.1:1"}, {"r1": 1})
    sub.handle("r1", batch(0, 1))
    assert index.block_count("r1") == 1
    sub.handle("r1", batch(1, 0))  # rank 0's publisher answered at rank 1's address
    assert index.block_count("r1") == 0
    assert _resets("r1", "rank") == 1
    sub.handle("r1", batch(2, None))  # an engine that names no rank is taken at its word
    assert index.block_count("r1") == 1


# -- the pick names the rank --------------------------------------------------------------------


async def _dp_router(header: str | None) -> Router:
    section: dict[str, Any] = {"size": 2} if header is None else {"size": 2, "header": header}
    config = with_ranks(
        parse_config(
            {
                "models": {"tiny": {"pools": ["dp"]}},
                "pools": {"dp": {"endpoints": ["127.0.0.1:8000"], "data_parallel": section}},
                "routing": {"fallbacks": 1},
            }
        )
    )
    store = MemoryStore()
    # Rank 0 is busy, rank 1 idle: the queue scorer must pick rank 1.
    for address, waiting in (("127.0.0.1:8000", 10), ("127.0.0.1:8001", 0)):
        await store.put_endpoint(
            EndpointState(address, "dp", True, EndpointMetrics(waiting=waiting), 1.0)
        )
    return Router(config, FleetState(store))


@pytest.mark.parametrize(
    ("header", "value"),
    [(None, "127.0.0.1:8001"), ("x-data-parallel-rank", "1")],
)
async def test_answer_goes_to_the_replica_and_names_the_rank(
    header: str | None, value: str
) -> None:
    handler = StreamHandler(await _dp_router(header))
    spoofed = {"x-data-parallel-host-port": "6.6.6.6:1", "x-data-parallel-rank": "7"}
    handler.handle(headers_msg(extra=spoofed))
    (answer,) = handler.handle(body_msg(BODY))
    dest, meta = destination(answer, "request_body")
    # Both ranks are one replica: Envoy gets its address once.
    assert dest == meta == "127.0.0.1:8000"
    mutation = answer.request_body.response.header_mutation
    sets = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    name = header or "x-data-parallel-host-port"
    assert sets[name] == value
    # The client's copies go; the one epp sets is not removed after being set.
    assert set(mutation.remove_headers) == set(spoofed) - {name}
    assert json.loads(BODY)["model"] == "tiny"


async def test_the_replica_envoy_reports_is_the_picked_rank_not_a_retry() -> None:
    router = await _dp_router(None)
    handler = StreamHandler(router)
    handler.handle(headers_msg())
    handler.handle(body_msg(BODY))
    handler.settle()
    assert handler.ticket is not None
    assert handler.ticket.endpoint == "127.0.0.1:8001"
    moved = REGISTRY.get_sample_value("epp_requests_moved_total") or 0.0
    # Envoy names the replica it sent to: the request stays on rank 1, nothing moved to rank 0.
    handler.handle(_response_headers({":status": "200", SERVED: "127.0.0.1:8000"}))
    assert handler.ticket.endpoint == "127.0.0.1:8001"
    assert router.fleet.inflight.load("127.0.0.1:8001").requests == 1
    assert router.fleet.inflight.load("127.0.0.1:8000").requests == 0
    assert (REGISTRY.get_sample_value("epp_requests_moved_total") or 0.0) == moved
    # A retry to another replica does move it there.
    other = StreamHandler(router)
    other.handle(headers_msg())
    other.handle(body_msg(BODY))
    other.handle(_response_headers({":status": "200", SERVED: "127.0.0.1:9000"}))
    assert other.ticket is not None
    assert other.ticket.endpoint == "127.0.0.1:9000"
