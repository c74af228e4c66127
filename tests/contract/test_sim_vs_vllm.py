"""`epp sim` against a real vLLM 0.32: same requests, same observable behaviour.

The trace (calibrate.build_trace) runs once on the session's real server and once on a
simulator replica configured like it; every test here compares the two records. What a router
reads must agree: metric names/types/labels, prefix-cache counters (the issue requires equal
queries and hits within 10 %; sequential phases must match exactly), KV usage, the KV event
wire format and contents, /tokenize. epp's own parsers are also run on the real server's output.

Runs only with EPP_CONTRACT=1 (conftest.py). Cost: the shared real server's start (~35 s) plus
~30 s per server for the trace.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from calibrate import (
    EventMessage,
    Target,
    TraceResult,
    build_trace,
    phase_table,
    removed_blocks,
    run_trace,
    sim_like,
    stored_blocks,
)
from conftest import RealVllm
from make_tiny_model import DEFAULT_LORA_DIR
from prometheus_client.parser import text_string_to_metric_families
from vllm_server import LORA_NAME

from epp.sim.kv_cache import hash_blocks, lora_extra_keys
from epp.sources.vllm_metrics import parse_vllm_metrics

pytestmark = pytest.mark.contract

# Families epp (and GIE/llm-d style routers) read, with their Prometheus types.
READ_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}
CACHE_CONFIG_SHARED = (
    "block_size",
    "num_gpu_blocks",
    "enable_prefix_caching",
    "kv_cache_size_tokens",
    "prefix_caching_hash_algo",
    "cache_dtype",
    "num_cpu_blocks",
    "engine",
)


@pytest.fixture(scope="module")
def real_target(real_vllm: RealVllm) -> Target:
    return Target(
        name="vllm",
        base_url=real_vllm.base_url,
        kv_events_endpoint=real_vllm.kv_events_endpoint,
        kv_topic=real_vllm.kv_topic,
        model=real_vllm.model,
        lora_name=real_vllm.lora_name,
    )


@pytest.fixture(scope="module")
def traces(real_target: Target, real_vllm: RealVllm) -> tuple[TraceResult, TraceResult]:
    """The trace on the real server, then on a simulator replica (never both at once: the
    box has 2 shared cores)."""
    real = run_trace(real_target, real_vllm.block_size)
    with sim_like(real_target) as sim_target:
        sim = run_trace(sim_target, real_vllm.block_size)
    return real, sim


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _label_keys(family: Any) -> dict[str, frozenset[str]]:
    """Sample name -> label names (all series of a sample name share them)."""
    out: dict[str, frozenset[str]] = {}
    for s in family.samples:
        out[s.name] = out.get(s.name, frozenset()) | frozenset(s.labels)
    return out


# --------------------------------------------------------------------------- (a) metrics
def test_metric_names_types_and_label_names_match(traces: tuple[TraceResult, TraceResult]) -> None:
    real, sim = (_families(t.metrics_text) for t in traces)
    for name, kind in READ_FAMILIES.items():
        assert name in real, f"real vLLM has no {name}"
        assert name in sim, f"sim has no {name}"
        assert (real[name].type, sim[name].type) == (kind, kind), name
        if name != "vllm:cache_config_info":
            assert _label_keys(sim[name]) == _label_keys(real[name]), name
        if kind == "histogram":
            buckets = [
                [s.labels["le"] for s in f.samples if s.name.endswith("_bucket")]
                for f in (real[name], sim[name])
            ]
            assert buckets[0] == buckets[1], f"{name} buckets differ"


def test_cache_config_info_agrees(traces: tuple[TraceResult, TraceResult]) -> None:
    """The sim publishes a subset of vLLM's ~35 CacheConfig labels, with the same values."""
    real, sim = (_families(t.metrics_text)["vllm:cache_config_info"].samples[0] for t in traces)
    assert set(sim.labels) <= set(real.labels), set(sim.labels) - set(real.labels)
    for key in CACHE_CONFIG_SHARED:
        assert sim.labels[key] == real.labels[key], key
    assert real.value == sim.value == 1.0


def test_lora_requests_info_agrees(traces: tuple[TraceResult, TraceResult]) -> None:
    """No engine/model_name labels; an adapter in flight is listed as running AND waiting
    (vLLM 0.32 joins the keys of both per-adapter counters); idle afterwards."""
    for trace in traces:
        fam = _families(trace.metrics_text)["vllm:lora_requests_info"]
        labels = {frozenset(s.labels) for s in fam.samples}
        assert labels == {frozenset({"max_lora", "running_lora_adapters", "waiting_lora_adapters"})}
        latest = max(fam.samples, key=lambda s: s.value)
        assert latest.labels["running_lora_adapters"] == "", trace.target
        assert latest.labels["waiting_lora_adapters"] == "", trace.target
        assert {s.labels["max_lora"] for s in fam.samples} == {"2"}
        phase = trace.phase("lora_in_flight")
        busy = [m for m in phase.samples if m.running_loras]
        seen = sorted(
            {(m.running, m.waiting, tuple(sorted(m.running_loras))) for m in phase.samples}
        )
        assert busy, (
            f"{trace.target}: tiny-lora never seen in flight in {len(phase.samples)} samples "
            f"(running, waiting, adapters seen: {seen}; failed scrapes: {phase.sample_errors[:3]})"
        )
        for m in busy:
            assert m.running_loras == m.waiting_loras == {"tiny-lora"}, trace.target
            assert m.max_loras == 2


# --------------------------------------------------------------------------- (b) counters
def test_prefix_cache_counters_agree(traces: tuple[TraceResult, TraceResult]) -> None:
    real, sim = traces
    table = "\n" + phase_table(real, sim)
    assert sim.queries == real.queries, table
    assert abs(sim.hits - real.hits) <= 0.10 * real.hits, table
    # Sequential phases are deterministic on both servers: they must match exactly.
    for r, s in zip(real.phases, sim.phases, strict=True):
        assert s.queries == r.queries, f"{r.name}{table}"
        if not r.timing_dependent:
            assert s.hits == r.hits, f"{r.name}{table}"


def test_known_vllm_counter_facts_hold_on_both(traces: tuple[TraceResult, TraceResult]) -> None:
    """The facts of tests/fixtures/vllm/README.md, re-measured on both servers."""
    for t in traces:
        got = {p.name: (p.queries, p.hits) for p in t.phases}
        assert got["repeat_500"] == (500, 480), t.target  # whole blocks only
        assert got["repeat_512_exact_blocks"] == (512, 480), t.target  # last block recomputed
        assert got["shared_300_of_500"] == (500, 288), t.target
        assert got["short_20_twice"] == (40, 0), t.target
        assert got["reset_then_500_twice"] == (1000, 480), t.target  # reset forgets everything


def test_preemptions_happen_on_both(traces: tuple[TraceResult, TraceResult]) -> None:
    """4 x (1000 + 600) tokens need ~200 blocks of 127: both servers must preempt. How often
    depends on step interleaving, so only the presence is compared; lookups of preempted
    requests are not counted in queries on either."""
    for t in traces:
        phase = t.phase("preempt_4x1000_plus_600")
        assert phase.preemptions >= 1, t.target
        assert phase.queries == 4000, t.target


# --------------------------------------------------------------------------- KV usage
def test_kv_usage_counts_shared_blocks_once_and_is_zero_when_idle(
    traces: tuple[TraceResult, TraceResult],
) -> None:
    """Two running requests sharing 480 tokens use 17 blocks (15 shared + 2 own), not 32.

    Usage grows by 2 blocks per 32 decoded tokens, and on a loaded box the first /metrics
    sample with both running can come late: the real server's minimum may exceed 17 by a few
    blocks (never near the 32 of unshared prefixes); the sim's must be exact."""
    mins = []
    for t in traces:
        phase = t.phase("usage_two_sharing_480")
        both = [m.kv_usage for m in phase.samples if m.running == 2]
        seen = sorted({(m.running, m.waiting) for m in phase.samples})
        assert both, (
            f"{t.target}: never saw 2 running in {len(phase.samples)} samples "
            f"(running, waiting seen: {seen}; failed scrapes: {phase.sample_errors[:3]})"
        )
        mins.append(round(min(both) * 127))
        assert parse_vllm_metrics(t.metrics_text).kv_usage == 0.0, t.target
    real, sim = mins
    assert sim == 17, mins
    assert 17 <= real <= 23, mins


# --------------------------------------------------------------------------- (c) KV events
def _check_wire(t: TraceResult) -> None:
    for m in t.messages:
        assert len(m.frames) == 3
        assert m.frames[0] == b"kv-events"
        assert len(m.frames[1]) == 8
        payload = m.payload
        assert len(payload) == 3
        assert isinstance(payload[0], float)
        assert math.isfinite(payload[0])
        assert payload[2] == 0  # data-parallel rank
        assert payload[1], "empty batches are never sent"


def _key_orders(t: TraceResult) -> dict[str, set[tuple[str, ...]]]:
    out: dict[str, set[tuple[str, ...]]] = {}
    for m in t.messages:
        for e in m.events:
            out.setdefault(e["type"], set()).add(tuple(e))
    return out


def test_kv_event_wire_format_and_field_order_match(
    traces: tuple[TraceResult, TraceResult],
) -> None:
    real, sim = traces
    for t in traces:
        _check_wire(t)
    orders = _key_orders(real)
    assert set(orders) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert _key_orders(sim) == orders
    assert orders["AllBlocksCleared"] == {("type",)}
    assert orders["BlockRemoved"] == {("type", "block_hashes", "medium", "group_idx")}


def test_kv_event_sequence_numbers(traces: tuple[TraceResult, TraceResult]) -> None:
    """+1 per message with no gap on both; the fresh sim starts at 0 (the shared real server
    has served other tests first, so its first seq is wherever it got to)."""
    for t in traces:
        seqs = [m.seq for m in t.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), t.target
    assert traces[1].messages[0].seq == 0


def _stored(messages: list[EventMessage]) -> list[dict[str, Any]]:
    return [e for m in messages for e in m.events if e["type"] == "BlockStored"]


def test_kv_event_field_values_match(traces: tuple[TraceResult, TraceResult]) -> None:
    for t in traces:
        for e in _stored(t.messages):
            n = len(e["block_hashes"])
            assert n >= 1
            assert len(e["token_ids"]) == 32 * n
            assert (e["block_size"], e["medium"], e["group_idx"]) == (32, "GPU", 0)
            assert e["kv_cache_spec_kind"] == "full_attention"
            assert len(e["extra_keys"]) == n
            if e["lora_name"] is None:
                assert e["lora_id"] is None
                assert e["extra_keys"] == [None] * n
            else:
                assert (e["lora_id"], e["lora_name"]) == (1, "tiny-lora"), t.target
                assert e["extra_keys"] == [["tiny-lora"]] * n
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in e["block_hashes"])
        for m in t.messages:
            for e in m.events:
                if e["type"] == "BlockRemoved":
                    assert len(e["block_hashes"]) == 1, "one BlockRemoved per evicted block"
                    assert (e["medium"], e["group_idx"]) == ("GPU", 0)
        lora = _stored(t.phase("lora_twice_then_base").messages)
        assert any(e["lora_name"] == "tiny-lora" for e in lora), t.target
        assert any(e["lora_name"] is None for e in lora), t.target


def test_kv_events_per_phase_match(traces: tuple[TraceResult, TraceResult]) -> None:
    """Sequential phases: same number of messages, same event types per message, same stored
    and removed block counts (so the sim evicts exactly what vLLM evicts)."""
    real, sim = traces
    table = "\n" + phase_table(real, sim)
    for r, s in zip(real.phases, sim.phases, strict=True):
        if r.timing_dependent:
            continue
        shape = [
            [(e["type"], len(e.get("block_hashes", ()))) for e in m.events] for m in r.messages
        ]
        sim_shape = [
            [(e["type"], len(e.get("block_hashes", ()))) for e in m.events] for m in s.messages
        ]
        assert sim_shape == shape, f"{r.name}{table}"
    assert stored_blocks(sim.messages) >= 0.95 * stored_blocks(real.messages), table
    assert removed_blocks(sim.messages) >= 0.95 * removed_blocks(real.messages), table


def test_evictions_come_before_the_steps_stores(traces: tuple[TraceResult, TraceResult]) -> None:
    for t in traces:
        evicting = [m for m in t.messages if any(e["type"] == "BlockRemoved" for e in m.events)]
        assert evicting, f"{t.target}: the trace must evict"
        for p in t.phases:
            if p.timing_dependent:
                continue  # two requests in one step interleave their removes and stores
            for m in p.messages:
                types = [e["type"] for e in m.events]
                if "BlockRemoved" in types and "BlockStored" in types:
                    assert types.index("BlockStored") > max(
                        i for i, x in enumerate(types) if x == "BlockRemoved"
                    ), (t.target, p.name, types)


def test_all_blocks_cleared_rides_with_the_next_step(
    traces: tuple[TraceResult, TraceResult],
) -> None:
    """Not sent when /reset_prefix_cache returns: queued, then published in the batch of the
    next engine step, ahead of that step's BlockStored."""
    for t in traces:
        for name in ("cold_500", "reset_then_500_twice"):
            first = t.phase(name).messages[0]
            assert [e["type"] for e in first.events] == ["AllBlocksCleared", "BlockStored"], (
                t.target,
                name,
            )


def _prompt_hashes() -> set[int]:
    """vLLM's hashes of every token-id prompt of the trace, computed offline."""
    out: set[int] = set()
    for phase in build_trace():
        for req in phase.requests:
            if isinstance(req.prompt, list):
                keys = lora_extra_keys(LORA_NAME, str(DEFAULT_LORA_DIR)) if req.lora else None
                out |= set(hash_blocks(req.prompt, 32, keys))
    return out


def test_block_hashes_are_vllms(traces: tuple[TraceResult, TraceResult]) -> None:
    """The sim hashes blocks exactly like vLLM (sha256 chain, LoRA name+path in the key): every
    prompt block stored by one server is stored under the same hash by the other, and both
    equal the offline recomputation. Blocks filled by decode differ (different output tokens)."""
    expected = _prompt_hashes()
    real, sim = ({h for e in _stored(t.messages) for h in e["block_hashes"]} for t in traces)
    assert len(real & expected) > 200, "offline hashing no longer matches vLLM"
    assert real & expected == sim & expected


# --------------------------------------------------------------------------- (d) /tokenize
def test_tokenize_and_detokenize_answers_are_identical(
    traces: tuple[TraceResult, TraceResult],
) -> None:
    real, sim = traces
    assert [s for s, _ in real.tokenize] == [200] * len(real.tokenize)
    for (rs, rb), (ss, sb) in zip(real.tokenize, sim.tokenize, strict=True):
        assert (ss, sb) == (rs, rb)


def test_models_list_matches(traces: tuple[TraceResult, TraceResult]) -> None:
    real, sim = (t.models["data"] for t in traces)
    assert [(m["id"], m["parent"], m["max_model_len"]) for m in sim] == [
        (m["id"], m["parent"], m["max_model_len"]) for m in real
    ]
    assert [sorted(m) for m in sim] == [sorted(m) for m in real]
    # The adapter's root is its path on both; the base model's root is the model dir on
    # vLLM and the tokenizer dir on the sim.
    assert sim[1]["root"] == real[1]["root"]


# --------------------------------------------------------------------------- (e) epp parsers
def test_epp_metrics_parser_reads_the_real_page(traces: tuple[TraceResult, TraceResult]) -> None:
    real, sim = traces
    m = parse_vllm_metrics(real.metrics_text)
    assert (m.block_size, m.num_gpu_blocks) == (32, 128)
    assert (m.running, m.waiting, m.kv_usage) == (0, 0, 0.0)
    assert m.prefix_cache_queries >= real.queries
    assert m.prefix_cache_hits >= real.hits
    assert m.preemptions >= 1
    assert m.max_loras == 2
    assert m.running_loras == m.waiting_loras == frozenset()
    # Under load the parser sees what the engine does (samples were parsed by it).
    phase = real.phase("usage_two_sharing_480")
    loaded = [s for s in phase.samples if s.running]
    assert loaded, (len(phase.samples), phase.sample_errors[:3])
    assert max(s.kv_usage for s in loaded) > 0.1
    assert all(0.0 <= s.kv_usage <= 1.0 for s in loaded)
    s = parse_vllm_metrics(sim.metrics_text)
    assert (s.block_size, s.num_gpu_blocks, s.max_loras) == (32, 128, 2)


def test_epp_kv_event_decoder_accepts_real_frames(
    traces: tuple[TraceResult, TraceResult],
) -> None:
    """epp's decoder (epp.sources.kv_events.decode_message) on every frame both servers sent
    during the trace: same seq, event kinds, hashes, parents and token ids as a plain msgpack
    decode. (tests/contract/test_kv_events_contract.py checks the index built from them.)"""
    from epp.sources import kv_events as dec

    kinds = {"BlockStored": dec.BlockStored, "BlockRemoved": dec.BlockRemoved}
    for t in traces:
        for m in t.messages:
            batch = dec.decode_message(m.frames)
            assert batch.seq == m.seq
            assert batch.ts == m.payload[0]
            assert len(batch.events) == len(m.events), t.target
            for got, raw in zip(batch.events, m.events, strict=True):
                assert isinstance(got, kinds.get(raw["type"], dec.AllBlocksCleared))
                if isinstance(got, dec.AllBlocksCleared):
                    continue
                assert got.block_hashes == raw["block_hashes"]
                if isinstance(got, dec.BlockStored):
                    assert got.parent_block_hash == raw["parent_block_hash"]
                    assert got.token_ids == raw["token_ids"]
                    assert got.lora_name == raw["lora_name"]
