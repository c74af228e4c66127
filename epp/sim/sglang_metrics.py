"""SGLang's Prometheus metrics for one replica (``epp sim --engine sglang``).

Names, types and label names follow SGLang's metrics collector (``SchedulerMetricsCollector``
and ``TokenizerMetricsCollector``, python/sglang/srt/metrics/collector.py at
sgl-project/sglang commit 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538); docs/sglang.md lists
what epp reads. The scheduler's gauges carry its rank labels, the tokenizer's series only the
model name; as in SGLang, the prompt and cached token counters grow when a request finishes.
Only the series a router or a dashboard reads are simulated, not SGLang's whole page.
"""

from __future__ import annotations

from epp.sim.engine import Engine
from epp.sim.exposition import Counter, Gauge, Histogram, Registry
from epp.sim.request import SimRequest
from epp.sim.scheduler import Batch

# SGLang's default buckets (TokenizerMetricsCollector).
TTFT_BUCKETS = [
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
]  # fmt: skip
E2E_BUCKETS = [
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
    1800, 2400,
]  # fmt: skip
ITL_BUCKETS = [
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
]  # fmt: skip


class SGLangMetrics:
    """Implements the engine's observer interface and renders /metrics in SGLang's names."""

    def __init__(
        self,
        model_name: str,
        max_total_num_tokens: int,
        registry: Registry | None = None,
        dp_rank: int | None = None,
    ) -> None:
        # The schedulers of a data-parallel server share one page; each adds its dp_rank.
        self.registry = r = Registry() if registry is None else registry
        # One unified (not disaggregated) scheduler on one rank.
        ranks = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        if dp_rank is not None:
            ranks["dp_rank"] = str(dp_rank)
        model = {"model_name": model_name}
        self.running = r.add(
            Gauge("sglang:num_running_reqs", "The number of running requests.")
        ).labels(**ranks)
        self.used_tokens = r.add(
            Gauge("sglang:num_used_tokens", "The number of used tokens.")
        ).labels(**ranks)
        self.token_usage = r.add(Gauge("sglang:token_usage", "The token usage.")).labels(**ranks)
        self.queue = r.add(
            Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        ).labels(**ranks)
        r.add(
            Gauge(
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
            )
        ).labels(**ranks).set(max_total_num_tokens)
        self.retracted = r.add(
            Counter("sglang:num_retracted_requests", "Total number of retracted requests.")
        ).labels(**ranks)
        self.prompt_tokens = r.add(
            Counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        ).labels(**model)
        self.generation_tokens = r.add(
            Counter("sglang:generation_tokens", "Number of generation tokens processed.")
        ).labels(**model)
        self.cached_tokens = r.add(
            Counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        ).labels(**model)
        self.requests = r.add(
            Counter("sglang:num_requests", "Number of requests processed.")
        ).labels(**model)
        self.ttft = r.add(
            Histogram(
                "sglang:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            )
        ).labels(**model)
        self.itl = r.add(
            Histogram(
                "sglang:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            )
        ).labels(**model)
        self.e2e = r.add(
            Histogram(
                "sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                E2E_BUCKETS,
            )
        ).labels(**model)
        self._seen_retracted = 0

    def on_step(self, engine: Engine, batch: Batch | None) -> None:
        self.refresh(engine)

    def refresh(self, engine: Engine) -> None:
        """Copy the engine's live state into the scheduler's gauges."""
        sched = engine.scheduler
        pool = engine.kv.pool
        self.running.set(len(sched.running))
        self.queue.set(len(sched.waiting))
        self.token_usage.set(pool.usage())
        self.used_tokens.set((pool.num_blocks - 1 - pool.num_free) * engine.config.block_size)
        self.retracted.inc(sched.num_preemptions - self._seen_retracted)
        self._seen_retracted = sched.num_preemptions

    def on_first_token(self, req: SimRequest) -> None:
        assert req.first_token_time is not None
        self.ttft.observe(req.first_token_time - req.arrival_time)

    def on_token(self, req: SimRequest, previous: float) -> None:
        assert req.last_token_time is not None
        self.generation_tokens.inc()
        if len(req.output_token_ids) > 1:
            self.itl.observe(req.last_token_time - previous)

    def on_finished(self, req: SimRequest) -> None:
        assert req.finish_time is not None
        self.requests.inc()
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.cached_tokens.inc(req.num_cached_tokens or 0)
        self.e2e.observe(req.finish_time - req.arrival_time)
