"""Scheduler + KV manager: batching limits, chunked prefill, FCFS, prefix hits, preemption,
LoRA slots. Driven step by step without the asyncio engine."""

from __future__ import annotations

from epp.sim.kv_cache import BlockPool
from epp.sim.kv_manager import KVCacheManager
from epp.sim.request import SimRequest, Status
from epp.sim.scheduler import Scheduler, SchedulerConfig


def make(
    blocks: int = 64, block_size: int = 4, seqs: int = 4, budget: int = 512, loras: int = 0
) -> Scheduler:
    kv = KVCacheManager(BlockPool(blocks, block_size))
    return Scheduler(SchedulerConfig(seqs, budget, loras), kv)


def req(name: str, prompt: list[int], max_tokens: int = 4, lora: str | None = None) -> SimRequest:
    return SimRequest(name, prompt, max_tokens, 0.0, lora)


def complete(sched: Scheduler, batch) -> None:
    """Apply a step's results like the engine: advance, sample, finish."""
    for r, n in batch.num_tokens.items():
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(7)
            if len(r.output_token_ids) >= r.max_tokens:
                sched.finish(r, Status.FINISHED)


def test_max_num_seqs_bounds_the_batch_and_the_rest_waits_fcfs() -> None:
    sched = make(seqs=2)
    reqs = [req(f"r{i}", [i] * 5) for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule(0.0)
    assert list(batch.num_tokens) == reqs[:2]
    assert list(sched.waiting) == [reqs[2]]
    assert all(r.status is Status.RUNNING for r in reqs[:2])


def test_prefill_is_chunked_to_the_token_budget_and_decodes_go_first() -> None:
    sched = make(budget=8)
    a, b = req("a", list(range(6))), req("b", list(range(100, 120)))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule(0.0)
    assert batch.num_tokens == {a: 6, b: 2}  # b gets what is left of the budget
    complete(sched, batch)
    batch = sched.schedule(0.0)
    assert batch.num_tokens == {a: 1, b: 7}  # a decodes (1 token), b continues its prefill
    complete(sched, batch)
    assert b.num_computed_tokens == 9
    assert not b.output_token_ids


def test_prefix_cache_hit_skips_cached_blocks_and_counts_tokens_like_vllm() -> None:
    sched = make(block_size=4)
    first = req("first", list(range(10)), max_tokens=1)
    sched.add(first)
    complete(sched, sched.schedule(0.0))
    assert first.status is Status.FINISHED
    second = req("second", [*range(8), 50, 51, 52])
    sched.add(second)
    batch = sched.schedule(0.0)
    assert batch.num_tokens == {second: 3}  # 2 full blocks (8 tokens) were cached
    assert second.num_cached_tokens == 8
    assert (sched.kv.stats.queries, sched.kv.stats.hits) == (10 + 11, 8)


def test_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    sched = make(block_size=4)
    a = req("a", list(range(8)), max_tokens=1)
    sched.add(a)
    complete(sched, sched.schedule(0.0))
    b = req("b", list(range(8)))
    sched.add(b)
    batch = sched.schedule(0.0)
    # Hits may cover at most 7 tokens -> only the first block: 4 tokens are recomputed.
    assert batch.num_tokens == {b: 4}
    assert sched.kv.stats.hits == 4


def test_kv_exhaustion_preempts_the_latest_running_request() -> None:
    # 6 usable blocks of 2 tokens. Each request's 4-token prompt takes 2 blocks.
    sched = make(blocks=7, block_size=2, budget=100)
    reqs = [req(f"r{i}", [i] * 4, max_tokens=10) for i in range(3)]
    for r in reqs:
        sched.add(r)
    complete(sched, sched.schedule(0.0))
    assert sched.kv.pool.num_free == 0
    # Every request now needs a 3rd block for its first generated token: the last admitted is
    # preempted (blocks freed, back to the front of the queue, computed tokens lost).
    batch = sched.schedule(0.0)
    assert batch.preempted == [reqs[2]]
    assert batch.num_tokens == {reqs[0]: 1, reqs[1]: 1}
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [reqs[2]]
    assert reqs[2].num_computed_tokens == 0
    assert reqs[2].status is Status.WAITING
    # Nothing else is admitted in a step that preempted.
    assert reqs[2] not in batch.num_tokens


def test_preempted_request_lookup_is_not_counted_in_prefix_stats() -> None:
    sched = make(blocks=7, block_size=2, budget=100)
    reqs = [req(f"r{i}", [i] * 4, max_tokens=10) for i in range(3)]
    for r in reqs:
        sched.add(r)
    complete(sched, sched.schedule(0.0))
    complete(sched, sched.schedule(0.0))  # preempts r2
    queries = sched.kv.stats.queries
    sched.finish(reqs[0], Status.ABORTED)  # make room so r2 is re-admitted
    sched.schedule(0.0)
    assert reqs[2].status is Status.RUNNING
    assert sched.kv.stats.queries == queries


def test_lora_requests_wait_when_all_adapter_slots_are_taken() -> None:
    sched = make(loras=1)
    a, b, base, a2 = (
        req("a", [1] * 4, lora="A"),
        req("b", [2] * 4, lora="B"),
        req("base", [3] * 4),
        req("a2", [4] * 4, lora="A"),
    )
    for r in (a, b, base, a2):
        sched.add(r)
    batch = sched.schedule(0.0)
    # B cannot get a slot while A runs; requests behind it are not blocked.
    assert set(batch.num_tokens) == {a, base, a2}
    assert list(sched.waiting) == [b]
    assert sched.running_loras() == {"A"}


def test_a_request_waiting_for_blocks_is_counted_once_when_admitted() -> None:
    """vLLM records prefix-cache stats at admission: a request whose lookup is retried over
    several steps (no free blocks yet) adds its tokens to queries once, not once per try."""
    sched = make(blocks=5, block_size=4)  # 4 usable blocks
    a = req("a", list(range(1, 13)), max_tokens=3)  # 3 blocks now, a 4th while decoding
    b = req("b", list(range(20, 29)), max_tokens=1)  # needs 3 blocks
    sched.add(a)
    complete(sched, sched.schedule(0.0))
    sched.add(b)
    for _ in range(2):  # b does not fit next to a: looked up, not admitted, not counted
        batch = sched.schedule(0.0)
        assert b not in batch.num_tokens
        assert sched.kv.stats.queries == 12
        complete(sched, batch)
    for _ in range(10):
        if b.status is not Status.WAITING:
            break
        complete(sched, sched.schedule(0.0))
    assert b.status is Status.FINISHED
    assert sched.kv.stats.queries == 12 + 9


def test_lora_in_flight_keeps_the_order_adapters_became_busy() -> None:
    sched = make(loras=2)
    x, y, x2 = (
        req("x", [1] * 5, lora="sql"),
        req("y", [2] * 5, lora="chat"),
        req("x2", [3] * 5, lora="sql"),
    )
    for r in (x, y, x2):
        sched.add(r)
    assert list(sched.lora_in_flight) == ["sql", "chat"]
    sched.finish(x, Status.FINISHED)
    assert sched.lora_in_flight == {"sql": 1, "chat": 1}
    sched.finish(x2, Status.ABORTED)
    assert list(sched.lora_in_flight) == ["chat"]


def test_preempt_all_requeues_running_requests_in_order() -> None:
    sched = make()
    a, b = req("a", [1] * 5), req("b", [2] * 5)
    sched.add(a)
    sched.add(b)
    sched.schedule(0.0)
    sched.preempt_all()
    assert sched.running == []
    assert list(sched.waiting) == [a, b]
    assert sched.kv.pool.num_used == 0


def test_loaded_tokens_are_not_prefilled_but_hold_blocks_and_cache() -> None:
    sched = make()
    r = req("pd", list(range(1, 30)))
    r.external_tokens = 28
    sched.add(r)
    batch = sched.schedule(0.0)
    assert batch.num_tokens == {r: 1}  # only the last prompt token is computed
    assert r.num_computed_tokens == 28
    assert len(sched.kv.req_blocks[r]) == 8
    assert sched.kv.stats.external_hits == 28
    complete(sched, batch)
    # The loaded blocks are cached: the same prompt elsewhere hits them locally.
    again = req("again", list(range(1, 30)))
    sched.add(again)
    assert sched.schedule(0.0).num_tokens[again] == 1
    assert sched.kv.stats.hits == 28
