"""The simulated engine: an asyncio task per replica that steps while there is work.

A step = schedule a batch, sleep for the modelled compute time (scaled by --time-scale
and the replica's --speed), then apply its results: advance computed tokens, sample one
token for every request whose tokens are all computed, finish requests that reached
max_tokens. Pausing (the `hang` fault) stops stepping between steps, so arrivals pile up in
the waiting queue as on a stuck server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from epp.sim.kv_cache import BlockPool, CacheEventListener
from epp.sim.kv_manager import KVCacheManager
from epp.sim.lora import LoraSlots
from epp.sim.profiles import Profile
from epp.sim.request import SimRequest, Status
from epp.sim.request_queue import SchedulingPolicy
from epp.sim.scheduler import Batch, Scheduler, SchedulerConfig

# How far stepping may fall behind its schedule before the debt is dropped.
MAX_LAG_S = 0.05


@dataclass(frozen=True)
class EngineConfig:
    profile: Profile
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_loras: int = 0
    time_scale: float = 1.0
    enable_prefix_caching: bool = True
    # Compute speed relative to the profile (2.0: every step takes half the time): replicas
    # of one fleet on faster or slower hardware. The API server's per-request overhead is CPU
    # work and does not change.
    speed: float = 1.0
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS

    @property
    def step_scale(self) -> float:
        """Wall-clock seconds per modelled second of engine compute."""
        return self.time_scale / self.speed


class EngineObserver(Protocol):
    """What the engine reports (metrics.py implements it)."""

    def on_step(self, engine: Engine, batch: Batch | None) -> None:
        """After scheduling (batch None) and after a batch has been computed."""

    def on_first_token(self, req: SimRequest) -> None: ...

    def on_token(self, req: SimRequest, previous: float) -> None: ...

    def on_finished(self, req: SimRequest) -> None: ...


@dataclass
class Engine:
    config: EngineConfig
    next_token: Callable[[SimRequest], int]
    observer: EngineObserver | None = None
    listener: CacheEventListener | None = None
    clock: Callable[[], float] = time.monotonic
    kv: KVCacheManager = field(init=False)
    scheduler: Scheduler = field(init=False)
    loras: LoraSlots = field(init=False)
    _work: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _unpaused: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _deadline: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        cfg = self.config
        pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, self.listener)
        self.kv = KVCacheManager(pool, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_loras, cfg.scheduling_policy
            ),
            self.kv,
        )
        self.loras = LoraSlots(cfg.max_loras, cfg.profile.lora_load_s)
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def pause(self) -> None:
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def submit(self, req: SimRequest) -> None:
        req.queued_time = self.clock()
        self.scheduler.add(req)
        self._work.set()

    def abort(self, req: SimRequest) -> None:
        """Client went away: drop the request and its blocks (vLLM aborts on disconnect)."""
        if not req.is_finished:
            self.scheduler.finish(req, Status.ABORTED)
            req.outputs.put_nowait(None)
            self._work.set()

    def step_time(self, batch: Batch) -> float:
        """Modelled compute time of one step, before --time-scale.

        Decode cost grows with the batch (per sequence) and with the context it reads (per
        token); prefill cost is per computed prompt token, so prefix-cache hits are cheap.
        """
        p = self.config.profile
        t = p.step_overhead_s
        for req, n in batch.num_tokens.items():
            if n == 1 and req.output_token_ids:
                t += p.decode_s_per_seq + p.attn_s_per_ctx_token * req.num_computed_tokens
            else:
                t += p.prefill_s_per_token * n
        return t

    async def _sleep_step(self, dt: float) -> None:
        """Sleep until this step's deadline, carried over from the previous step.

        Event-loop timers are coarse (libuv: 1 ms) and each step costs some CPU, so sleeping
        `dt` per step would make short (time-scaled) steps systematically slow. Stepping on
        deadlines keeps the average step rate right; a lag beyond MAX_LAG_S (CPU starved) is
        forgiven rather than caught up in a burst.
        """
        now = self.clock()
        if now - self._deadline > MAX_LAG_S:
            self._deadline = now
        self._deadline += dt
        # Always yield, even when behind: the HTTP handlers share this loop.
        await asyncio.sleep(max(0.0, self._deadline - now))

    async def run(self) -> None:
        while True:
            await self._unpaused.wait()
            if not self.scheduler.has_work():
                self._work.clear()
                await self._work.wait()
                self._deadline = self.clock()  # idle time is not owed to later steps
                continue
            batch = self.scheduler.schedule(self.clock())
            if self.observer:
                self.observer.on_step(self, None)
            if not batch:
                # Only when the last running request preempted itself; it is re-admitted
                # next step. Pause one step's overhead rather than spin.
                await self._sleep_step(self.config.profile.step_overhead_s * self.config.step_scale)
                self._end_step()
                continue
            dt = self.step_time(batch)
            dt += self.loras.activate(r.lora for r in batch.num_tokens if r.lora)
            await self._sleep_step(dt * self.config.step_scale)
            self._complete(batch)
            self._end_step()
            if self.observer:
                self.observer.on_step(self, batch)

    def _end_step(self) -> None:
        """Hand the step's cache events over as one batch (vLLM publishes them after the
        step's model run, together with its outputs)."""
        if self.listener:
            self.listener.end_step()

    def _complete(self, batch: Batch) -> None:
        now = self.clock()
        for req, n in batch.num_tokens.items():
            if req.status is not Status.RUNNING:  # aborted or preempted during the step
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # chunked prefill: more prompt to go
            token = self.next_token(req)
            req.append_output(token)
            if req.first_token_time is None:
                req.first_token_time = now
                if self.observer:
                    self.observer.on_first_token(req)
            previous, req.last_token_time = req.last_token_time or now, now
            if self.observer:
                self.observer.on_token(req, previous)
            req.outputs.put_nowait([token])
            if len(req.output_token_ids) >= req.max_tokens:
                self.scheduler.finish(req, Status.FINISHED)
                req.finish_time = now
                if self.observer:
                    self.observer.on_finished(req)
                req.outputs.put_nowait(None)
