"""Continuous-batching scheduler modelled on vLLM v1's (policies fcfs and priority).

Each step gets a token budget (max_num_batched_tokens). Running requests are served first, in
order: a decode needs 1 token, an unfinished prefill the rest of its prompt (chunked to the
budget). When KV blocks run out a running request is preempted (recompute: its blocks are
freed and it goes back to the waiting queue): under fcfs the most recently admitted one,
under priority the one with the highest (priority, arrival time), which may be one already
scheduled this step (its tokens are given back) or the request that needed the blocks. Then,
if nothing was preempted, waiting requests are admitted in queue order (request_queue.py)
while the budget, max_num_seqs, the KV pool and LoRA slots allow; a request whose adapter
cannot get a slot is skipped so the ones behind it are not blocked. A waiting request never
preempts a running one, whatever its priority: admission stops at the first that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.sim.kv_manager import KVCacheManager
from epp.sim.request import SimRequest, Status
from epp.sim.request_queue import RequestQueue, SchedulingPolicy, make_queue


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int = 0
    policy: SchedulingPolicy = SchedulingPolicy.FCFS


@dataclass
class Batch:
    """What one engine step computes: tokens per request."""

    num_tokens: dict[SimRequest, int] = field(default_factory=dict)
    preempted: list[SimRequest] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.num_tokens)


@dataclass
class Scheduler:
    config: SchedulerConfig
    kv: KVCacheManager
    waiting: RequestQueue = field(init=False)
    running: list[SimRequest] = field(default_factory=list)
    num_preemptions: int = 0
    # Requests in flight (waiting or running) per adapter, in the order the adapters became
    # busy: what vLLM's LoRARequestStates reports in vllm:lora_requests_info.
    lora_in_flight: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.waiting = make_queue(self.config.policy)

    def add(self, req: SimRequest) -> None:
        self.waiting.add(req)
        if req.lora:
            self.lora_in_flight[req.lora] = self.lora_in_flight.get(req.lora, 0) + 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_loras(self) -> set[str]:
        return {r.lora for r in self.running if r.lora}

    def schedule(self, now: float) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self._victim()
                if victim in batch.num_tokens:
                    # Scheduled earlier this step: give its tokens back; the list shifts left.
                    budget += batch.num_tokens.pop(victim)
                    i -= 1
                self.running.remove(victim)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.num_tokens[req] = n
                budget -= n
                i += 1
                continue
            break
        if not batch.preempted:
            self._admit(batch, budget, now)
        return batch

    def _victim(self) -> SimRequest:
        if self.config.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _admit(self, batch: Batch, budget: int, now: float) -> None:
        skipped: list[SimRequest] = []
        loras = self.running_loras()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req.lora and req.lora not in loras and len(loras) >= self.config.max_loras:
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            loaded = self._loaded(req, num_hit)
            n = min(req.num_tokens - num_hit - loaded, budget)
            # Loaded tokens take blocks like computed ones (and are cached once full).
            if not self.kv.allocate_slots(req, loaded + n, hits):
                break
            self.kv.record_prefix_cache_stats(req, num_hit)
            if req.external_tokens is not None and req.scheduled_time is None:
                self.kv.stats.external_queries += req.num_tokens
                self.kv.stats.external_hits += loaded
            self.waiting.pop()
            req.num_computed_tokens = num_hit + loaded
            req.status = Status.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = now
                req.num_cached_tokens = num_hit
            if req.lora:
                loras.add(req.lora)
            self.running.append(req)
            batch.num_tokens[req] = n
            budget -= n
        for req in reversed(skipped):
            self.waiting.prepend(req)

    @staticmethod
    def _loaded(req: SimRequest, num_hit: int) -> int:
        """Tokens a KV connector loads at the request's first admission: those it brought
        (epp.sim.kv_transfer) past what the local prefix cache already holds."""
        if not req.external_tokens or req.scheduled_time is not None:
            return 0
        return max(0, req.external_tokens - num_hit)

    def preempt_all(self) -> None:
        """Send every running request back to the waiting queue (vLLM's reset_prefix_cache
        with reset_running_requests), last admitted first so the queue keeps their order."""
        while self.running:
            self._preempt(self.running.pop())

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def finish(self, req: SimRequest, status: Status) -> None:
        """Remove a request (finished or aborted) wherever it is and free its blocks."""
        in_flight = True
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            in_flight = False  # never submitted, or already finished
        self.kv.free(req)
        req.status = status
        if in_flight and req.lora and req.lora in self.lora_in_flight:
            self.lora_in_flight[req.lora] -= 1
            if not self.lora_in_flight[req.lora]:
                del self.lora_in_flight[req.lora]
