"""One simulated vLLM server: engine + tokenizer + metrics + KV events + HTTP listener.

With ``speaks="sglang"`` its /metrics page and KV events are SGLang's instead (the OpenAI API
and the scheduling model stay the same).

Several replicas can live in one process (--replicas): each has its own engine task, metrics
registry, event publisher and listening socket, and shares only the event loop and tokenizer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field

from aiohttp import web

from epp.data_parallel import offset_events_address
from epp.sim.engine import Engine, EngineConfig
from epp.sim.exposition import Registry
from epp.sim.faults import Faults
from epp.sim.kv_events import KVEventPublisher, SGLangEventPublisher
from epp.sim.kv_transfer import KVTransfer, KVTransferConfig
from epp.sim.metrics import EngineMetrics
from epp.sim.request import SimRequest
from epp.sim.sglang_metrics import SGLangMetrics
from epp.sim.tokenization import SimTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaConfig:
    host: str
    port: int
    model: str
    engine: EngineConfig
    lora_modules: dict[str, str] = field(default_factory=dict)
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    enable_prompt_tokens_details: bool = False
    # A crash fault ends the process when this replica is alone in it; with --replicas (or in
    # tests) it only drops this replica's listener and connections.
    crash_exits_process: bool = False
    # A KV connector (prefill/decode disaggregation), or None.
    kv_transfer: KVTransferConfig | None = None
    # Whose /metrics names and KV-event format the replica uses: "vllm" or "sglang".
    speaks: str = "vllm"
    # Engines behind this one server (vLLM's --data-parallel-size, SGLang's --dp-size): each
    # schedules and caches on its own, labels its series with its rank and publishes its KV
    # events at the endpoint's port plus its rank.
    data_parallel_size: int = 1

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class Replica:
    def __init__(self, config: ReplicaConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.faults = Faults()
        # vLLM numbers adapters from 1 in --lora-modules order; KV events carry the id.
        self.lora_ids = {name: i for i, name in enumerate(config.lora_modules, start=1)}
        ecfg = config.engine
        cache_info = {
            "block_size": str(ecfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(ecfg.enable_prefix_caching),
            "num_gpu_blocks": str(ecfg.num_gpu_blocks),
            "num_cpu_blocks": "None",
            "kv_cache_size_tokens": str(ecfg.num_gpu_blocks * ecfg.block_size),
            "prefix_caching_hash_algo": "sha256",
        }
        self.registry = Registry()
        self.rank_metrics = [
            self._metrics(rank, cache_info) for rank in range(config.data_parallel_size)
        ]
        self.rank_events = [self._events(rank) for rank in range(config.data_parallel_size)]
        self.engines = [
            Engine(ecfg, self._next_token, metrics, events)
            for metrics, events in zip(self.rank_metrics, self.rank_events, strict=True)
        ]
        # Rank 0: the whole replica without data parallelism.
        self.engine, self.metrics, self.events = (
            self.engines[0],
            self.rank_metrics[0],
            self.rank_events[0],
        )
        self.kv_transfer = (
            None
            if config.kv_transfer is None
            else KVTransfer(config.kv_transfer, config.host, config.port, ecfg.block_size)
        )
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _metrics(self, rank: int, cache_info: dict[str, str]) -> EngineMetrics | SGLangMetrics:
        config, ecfg = self.config, self.config.engine
        if config.speaks == "sglang":
            tokens = (ecfg.num_gpu_blocks - 1) * ecfg.block_size
            dp_rank = rank if config.data_parallel_size > 1 else None
            return SGLangMetrics(config.model, tokens, self.registry, dp_rank)
        return EngineMetrics(
            config.model, cache_info, ecfg.max_loras, ecfg.max_model_len, self.registry, rank
        )

    def _events(self, rank: int) -> KVEventPublisher | None:
        config = self.config
        if not config.kv_events_endpoint:
            return None
        publisher = SGLangEventPublisher if config.speaks == "sglang" else KVEventPublisher
        endpoint = offset_events_address(config.kv_events_endpoint, rank)
        block_size = config.engine.block_size
        return publisher(endpoint, config.kv_events_topic, block_size, self.lora_ids, rank)

    def engine_for(self, rank: int | None) -> Engine:
        """The engine of ``rank``, or without one the least loaded (vLLM's own balancing:
        waiting requests count four times running ones)."""
        if rank is not None:
            return self.engines[rank]
        return min(
            self.engines, key=lambda e: 4 * len(e.scheduler.waiting) + len(e.scheduler.running)
        )

    def render_metrics(self) -> bytes:
        for metrics, engine in zip(self.rank_metrics, self.engines, strict=True):
            metrics.refresh(engine)
        return self.registry.render()

    def _next_token(self, req: SimRequest) -> int:
        return self.tokenizer.filler_token(req.prompt_token_ids, len(req.output_token_ids))

    async def start(self) -> None:
        from epp.sim.server import make_app  # server imports Replica for typing

        for rank, engine in enumerate(self.engines):
            name = f"engine {self.config.address} rank {rank}"
            self._tasks.append(asyncio.create_task(engine.run(), name=name))
        for events in self.rank_events:
            if events is not None:
                events.start()
                self._tasks.append(asyncio.create_task(events.run(), name="kv-events"))
        # handler_cancellation: a client that disconnects aborts its request, as in vLLM.
        self._runner = web.AppRunner(make_app(self), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        await site.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._runner:
            await self._runner.cleanup()
            self._runner = None
        for events in self.rank_events:
            if events is not None:
                events.close()

    def crash(self) -> None:
        """Die abruptly: no graceful close, open connections are reset."""
        if self.config.crash_exits_process:
            log.warning("crash fault: exiting")
            os._exit(1)
        log.warning("crash fault: dropping replica %s", self.config.address)
        asyncio.get_running_loop().create_task(self._crash())

    async def _crash(self) -> None:
        # Listeners first: a connection accepted after the resets below would otherwise be
        # served by a half-stopped replica and hang until the runner's shutdown timeout.
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()
        server = self._runner.server
        for handler in list(server.connections) if server else []:
            if handler.transport is not None:
                handler.transport.abort()
        await self.stop()
