"""The asyncio engine: generation, pause/resume, timing model, LoRA load cost."""

from __future__ import annotations

import asyncio

import pytest

from epp.sim.engine import Engine
from epp.sim.lora import LoraSlots
from epp.sim.request import SimRequest, Status
from epp.sim.scheduler import Batch

from .conftest import engine_config


def new_engine(**overrides) -> Engine:
    return Engine(engine_config(**overrides), next_token=lambda r: 100 + len(r.output_token_ids))


async def drain(req: SimRequest) -> list[int]:
    out: list[int] = []
    while (ids := await req.outputs.get()) is not None:
        out += ids
    return out


async def test_generates_exactly_max_tokens_then_ends() -> None:
    engine = new_engine()
    task = asyncio.create_task(engine.run())
    try:
        r = SimRequest("r", list(range(10)), 5, 0.0)
        engine.submit(r)
        assert await asyncio.wait_for(drain(r), 5) == [100, 101, 102, 103, 104]
        assert r.status is Status.FINISHED
        assert r.first_token_time is not None
        assert r.finish_time is not None
        assert r.first_token_time <= r.finish_time
        assert engine.kv.pool.usage() == 0.0  # blocks released
    finally:
        task.cancel()


async def test_pause_holds_requests_in_the_waiting_queue_until_resumed() -> None:
    engine = new_engine()
    task = asyncio.create_task(engine.run())
    try:
        engine.pause()
        reqs = [SimRequest(f"r{i}", [i] * 6, 3, 0.0) for i in range(3)]
        for r in reqs:
            engine.submit(r)
        await asyncio.sleep(0.05)
        assert len(engine.scheduler.waiting) == 3
        assert all(r.outputs.empty() for r in reqs)
        engine.resume()
        outs = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in reqs)), 5)
        assert [len(o) for o in outs] == [3, 3, 3]
    finally:
        task.cancel()


async def test_abort_frees_the_request() -> None:
    engine = new_engine(time_scale=1.0)
    task = asyncio.create_task(engine.run())
    try:
        r = SimRequest("r", list(range(40)), 1000, 0.0)
        engine.submit(r)
        await asyncio.sleep(0.02)
        engine.abort(r)
        assert r.status is Status.ABORTED
        assert not engine.scheduler.has_work()
        assert engine.kv.pool.usage() == 0.0
    finally:
        task.cancel()


def test_step_time_charges_uncached_prefill_and_grows_with_decode_batch() -> None:
    engine = new_engine()
    p = engine.config.profile
    prefill = SimRequest("p", list(range(100)), 4, 0.0)
    assert engine.step_time(Batch({prefill: 100})) > engine.step_time(Batch({prefill: 20}))
    decoders = []
    for i in range(4):
        d = SimRequest(f"d{i}", list(range(50)), 4, 0.0, output_token_ids=[1])
        d.num_computed_tokens = 50
        decoders.append(d)
    one = engine.step_time(Batch({decoders[0]: 1}))
    four = engine.step_time(Batch(dict.fromkeys(decoders, 1)))
    assert four - one == pytest.approx(3 * (p.decode_s_per_seq + p.attn_s_per_ctx_token * 50))


def test_lora_slots_charge_loads_and_evict_least_recently_used() -> None:
    slots = LoraSlots(max_loras=2, load_s=0.5)
    assert slots.activate(["a", "b"]) == 1.0
    assert slots.activate(["a"]) == 0.0  # resident: free; a is now most recent
    assert slots.activate(["c"]) == 0.5  # evicts b
    assert list(slots.resident) == ["a", "c"]


async def test_requests_preempted_for_kv_space_are_recomputed_and_finish() -> None:
    # 8 usable blocks of 4 tokens; each request grows to 16 tokens (4 blocks): 3 cannot fit.
    engine = new_engine(num_gpu_blocks=9, block_size=4, max_model_len=32)
    task = asyncio.create_task(engine.run())
    try:
        reqs = [SimRequest(f"r{i}", [i + 1] * 8, 8, 0.0) for i in range(3)]
        for r in reqs:
            engine.submit(r)
        outs = await asyncio.wait_for(asyncio.gather(*(drain(r) for r in reqs)), 5)
        assert [len(o) for o in outs] == [8, 8, 8]
        assert engine.scheduler.num_preemptions >= 1
        assert any(r.num_preemptions for r in reqs)
    finally:
        task.cancel()


async def test_a_faster_replica_sleeps_a_shorter_step() -> None:
    """--speed divides every step's modelled time (the same batch, half the wall clock)."""
    slept: dict[float, list[float]] = {}
    for speed in (1.0, 2.0):
        engine = new_engine(speed=speed)
        naps = slept[speed] = []

        async def nap(dt: float, naps: list[float] = naps) -> None:
            naps.append(dt)
            await asyncio.sleep(0)

        engine._sleep_step = nap  # type: ignore[method-assign]
        task = asyncio.create_task(engine.run())
        try:
            r = SimRequest("r", list(range(10)), 3, 0.0)
            engine.submit(r)
            await asyncio.wait_for(drain(r), 5)
        finally:
            task.cancel()
    assert len(slept[1.0]) == len(slept[2.0]) == 3
    assert slept[2.0] == pytest.approx([dt / 2 for dt in slept[1.0]])
