"""vLLM's `--scheduling-policy priority` in the simulator: queue order, which running request
is preempted when blocks run out, what a waiting request may not do, and the body's field."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from epp.sim.cli import add_subcommand, build_configs
from epp.sim.kv_cache import BlockPool
from epp.sim.kv_manager import KVCacheManager
from epp.sim.request import SimRequest, Status
from epp.sim.request_queue import PriorityQueue, SchedulingPolicy
from epp.sim.scheduler import Scheduler, SchedulerConfig

from .conftest import engine_config
from .test_scheduler import complete
from .test_server import post

PRIORITY = SchedulingPolicy.PRIORITY
FCFS = SchedulingPolicy.FCFS


def make(policy: SchedulingPolicy, blocks: int = 64, seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(seqs, 100, 0, policy), KVCacheManager(BlockPool(blocks, 2)))


def req(name: str, priority: int, arrival: float, max_tokens: int = 10) -> SimRequest:
    # 4-token prompts, distinct per arrival time (no shared prefix): 2 blocks of 2 tokens
    # each, a 3rd with the first generated token.
    prompt = [int(arrival * 10) + 1, priority + 50, 7, 9]
    return SimRequest(name, prompt, max_tokens, arrival, priority=priority)


@pytest.mark.parametrize(
    ("policy", "order"),
    [(PRIORITY, ["crit", "early", "late", "batch"]), (FCFS, ["batch", "late", "crit", "early"])],
)
def test_waiting_requests_are_admitted_by_priority_then_arrival(
    policy: SchedulingPolicy, order: list[str]
) -> None:
    sched = make(policy, seqs=4)
    for r in (
        req("batch", 5, 0.0),
        req("late", 0, 2.0),
        req("crit", -1, 3.0),
        req("early", 0, 1.0),
    ):
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == order
    batch = sched.schedule(0.0)
    assert [r.request_id for r in batch.num_tokens] == order


def run_until_blocks_run_out(policy: SchedulingPolicy) -> tuple[Scheduler, list[SimRequest]]:
    """A batch request admitted first, then two critical ones; 6 usable blocks. Returns the
    scheduler after the step in which a running request needed a block and none was free."""
    sched = make(policy, blocks=7)
    batch, c1, c2 = req("batch", 1, 0.0), req("c1", 0, 1.0), req("c2", 0, 2.0)
    sched.add(batch)
    complete(sched, sched.schedule(0.0))
    sched.add(c1)
    sched.add(c2)
    for _ in range(10):
        step = sched.schedule(0.0)
        if step.preempted:
            return sched, [batch, c1, c2, *step.preempted]
        complete(sched, step)
    raise AssertionError("blocks never ran out")


def test_fcfs_preempts_the_latest_admitted_request_even_a_critical_one() -> None:
    _, (batch, c1, _, *preempted) = run_until_blocks_run_out(FCFS)
    assert preempted == [c1]
    assert batch.status is Status.RUNNING


def test_priority_preempts_the_lowest_priority_request_and_queues_it_behind_critical() -> None:
    sched, (batch, c1, c2, *preempted) = run_until_blocks_run_out(PRIORITY)
    assert preempted == [batch]
    assert (batch.status, batch.num_computed_tokens, batch.num_preemptions) == (
        Status.WAITING,
        0,
        1,
    )
    assert c1.status is Status.RUNNING
    # The preempted request rejoins by its key: the waiting critical request goes first.
    assert list(sched.waiting) == [c2, batch]


@pytest.mark.parametrize("policy", [PRIORITY, FCFS])
def test_a_victim_already_scheduled_this_step_gives_its_tokens_back(
    policy: SchedulingPolicy,
) -> None:
    """Under priority the victim may come before the request needing blocks in the running
    list (vLLM's max over all of it): it leaves the batch, the budget gets its tokens back and
    the needy request is scheduled. Under fcfs the needy request, last admitted, is the victim."""
    sched = make(policy, blocks=5)  # 4 usable blocks
    low = SimRequest("low", [1, 2], 10, 0.0, priority=1)  # 1 block, a 2nd for its 3rd token
    sched.add(low)
    complete(sched, sched.schedule(0.0))
    crit = req("crit", 0, 1.0)  # 2 blocks, a 3rd with its first generated token
    sched.add(crit)
    complete(sched, sched.schedule(0.0))  # all 4 blocks in use
    assert sched.running == [low, crit]
    step = sched.schedule(0.0)  # low fits its 4th token; crit needs a block, none is free
    if policy is PRIORITY:
        assert (step.preempted, step.num_tokens) == ([low], {crit: 1})
        assert sched.running == [crit]
    else:
        assert (step.preempted, step.num_tokens) == ([crit], {low: 1})
        assert sched.running == [low]


def test_a_waiting_critical_request_does_not_preempt_running_batch() -> None:
    sched = make(PRIORITY, blocks=5)  # 4 usable blocks: two running 4-token prompts
    b1, b2 = req("b1", 1, 0.0), req("b2", 1, 1.0)
    sched.add(b1)
    sched.add(b2)
    complete(sched, sched.schedule(0.0))
    crit = req("crit", -5, 2.0)
    sched.add(crit)
    step = sched.schedule(0.0)
    assert crit.status is Status.WAITING
    assert crit not in step.num_tokens
    assert b1.status is Status.RUNNING


def test_priority_queue_removes_and_iterates_in_service_order() -> None:
    queue = PriorityQueue()
    a, b, c = req("a", 2, 0.0), req("b", 1, 5.0), req("c", 1, 1.0)
    for r in (a, b, c):
        queue.add(r)
    assert list(queue) == [c, b, a]
    queue.remove(b)
    assert b not in queue
    assert (len(queue), queue.pop(), queue.peek()) == (2, c, a)


def test_cli_takes_vllms_flag() -> None:
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    (config,) = build_configs(parser.parse_args(["sim", "--scheduling-policy", "priority"]))
    assert config.engine.scheduling_policy is PRIORITY
    (config,) = build_configs(parser.parse_args(["sim"]))
    assert config.engine.scheduling_policy is FCFS
    with pytest.raises(SystemExit):
        parser.parse_args(["sim", "--scheduling-policy", "sjf"])


async def test_the_body_priority_orders_a_replica_queue(start_replica) -> None:
    """Through HTTP: with the engine paused, a batch request queued first is served after a
    critical one queued later (max_num_seqs 1: one at a time)."""
    r = await start_replica(engine_config(max_num_seqs=1, scheduling_policy=PRIORITY))
    await post(r, "/admin/faults", {"hang": True})
    done: list[str] = []

    async def send(name: str, priority: int) -> None:
        body = {"prompt": name, "max_tokens": 2, "priority": priority}
        status, _, _ = await post(r, "/v1/completions", body)
        assert status == 200
        done.append(name)

    tasks = [asyncio.create_task(send("batch", 10))]
    await asyncio.sleep(0.05)
    tasks.append(asyncio.create_task(send("critical", -10)))
    for _ in range(200):
        if len(r.engine.scheduler.waiting) == 2:
            break
        await asyncio.sleep(0.01)
    await post(r, "/admin/faults", {"hang": False})
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert done == ["critical", "batch"]


async def test_fcfs_accepts_a_priority_and_ignores_it(start_replica) -> None:
    """vLLM v1 validates no priority against the policy (v0 answered 400): under fcfs the
    field is accepted and has no effect."""
    r = await start_replica()
    status, _, body = await post(r, "/v1/completions", {"prompt": "x", "priority": 3})
    assert status == 200
    assert body["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("value", ["high", 1.5, True, None])
async def test_a_priority_that_is_not_an_integer_is_a_400(start_replica, value: object) -> None:
    r = await start_replica(engine_config(scheduling_policy=PRIORITY))
    status, _, body = await post(r, "/v1/completions", {"prompt": "x", "priority": value})
    assert (status, body["error"]["param"]) == (400, "priority")
