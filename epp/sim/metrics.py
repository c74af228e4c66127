"""vLLM's Prometheus metrics for one replica, in its own CollectorRegistry.

Names, label names, types and histogram buckets follow vLLM v1 (vllm/v1/metrics/loggers.py)
so scrapers written for vLLM (GIE, llm-d, epp) read the simulator unchanged. Latencies are
wall-clock seconds as observed by clients, i.e. already shrunk by --time-scale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from epp.sim.engine import Engine
from epp.sim.exposition import (
    Counter,
    CounterChild,
    Gauge,
    GaugeChild,
    Histogram,
    HistogramChild,
    Registry,
)
from epp.sim.request import SimRequest
from epp.sim.scheduler import Batch

# vLLM's bucket boundaries.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ... <= max."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


class EngineMetrics:
    """Implements the engine's observer interface and renders /metrics."""

    def __init__(
        self,
        model_name: str,
        cache_info: dict[str, str],
        max_loras: int,
        max_model_len: int,
        registry: Registry | None = None,
        rank: int = 0,
    ) -> None:
        # The engines of a data-parallel server share one page, each labelled engine="rank".
        self.registry = r = Registry() if registry is None else registry
        self.max_loras = max_loras
        labels = {"engine": str(rank), "model_name": model_name}

        def gauge(name: str, doc: str) -> GaugeChild:
            return r.add(Gauge(name, doc)).labels(**labels)

        def counter(name: str, doc: str) -> CounterChild:
            return r.add(Counter(name, doc)).labels(**labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> HistogramChild:
            return r.add(Histogram(name, doc, buckets)).labels(**labels)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms "
            "of number of cached tokens.",
        )
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = r.add(
            Counter("vllm:request_success", "Count of successfully processed requests.")
        )
        # vLLM creates every finish reason's series up front; the simulator only ends by
        # length (it never samples EOS or a stop string).
        for reason in ("stop", "length", "abort", "error", "repetition"):
            success.labels(**labels, finished_reason=reason)
        self.success = success.labels(**labels, finished_reason="length")
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        )
        self._request_histograms(histogram, max_model_len)
        info_labels = {**cache_info, "engine": str(rank)}
        r.add(Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig")).labels(
            **info_labels
        ).set(1)
        # No engine/model_name labels, as in vLLM.
        self.lora_info = r.add(Gauge("vllm:lora_requests_info", "Running stats on lora requests."))
        self._seen_prefix = (0, 0)
        self._seen_external = (0, 0)
        self._seen_preemptions = 0

    def _request_histograms(
        self,
        histogram: Callable[[str, str, Sequence[float]], HistogramChild],
        max_model_len: int,
    ) -> None:
        """Each request's latencies, phase times and token counts, in vLLM's buckets."""
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            token_buckets(max_model_len),
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets(max_model_len),
        )

    def on_step(self, engine: Engine, batch: Batch | None) -> None:
        self.refresh(engine)
        if self.max_loras:
            # vLLM records a label set per engine step, stamped with the time; old ones linger
            # (read the series with the largest value), and the series is absent before the
            # first step. Like vLLM 0.32, an adapter with any request in flight is listed as
            # both running and waiting: vLLM joins the keys of two per-adapter counters that
            # always have the same keys.
            adapters = ",".join(engine.scheduler.lora_in_flight)
            self.lora_info.labels(
                max_lora=str(self.max_loras),
                running_lora_adapters=adapters,
                waiting_lora_adapters=adapters,
            ).set(time.time())
        if batch:
            self.iteration_tokens.observe(sum(batch.num_tokens.values()))

    def refresh(self, engine: Engine) -> None:
        """Copy the engine's live state into the gauges and counters."""
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(engine.kv.pool.usage())
        stats = engine.kv.stats
        q, h = self._seen_prefix
        self.prefix_queries.inc(stats.queries - q)
        self.prefix_hits.inc(stats.hits - h)
        self._seen_prefix = (stats.queries, stats.hits)
        eq, eh = self._seen_external
        self.external_queries.inc(stats.external_queries - eq)
        self.external_hits.inc(stats.external_hits - eh)
        self._seen_external = (stats.external_queries, stats.external_hits)
        self.preemptions.inc(sched.num_preemptions - self._seen_preemptions)
        self._seen_preemptions = sched.num_preemptions

    def on_first_token(self, req: SimRequest) -> None:
        assert req.first_token_time is not None
        self.ttft.observe(req.first_token_time - req.arrival_time)
        self.prompt_tokens.inc(req.num_prompt_tokens)

    def on_token(self, req: SimRequest, previous: float) -> None:
        assert req.last_token_time is not None
        self.generation_tokens.inc()
        if len(req.output_token_ids) > 1:
            self.itl.observe(req.last_token_time - previous)

    def on_finished(self, req: SimRequest) -> None:
        assert req.finish_time is not None
        assert req.first_token_time is not None
        assert req.scheduled_time is not None
        assert req.queued_time is not None
        self.success.inc()
        self.e2e.observe(req.finish_time - req.arrival_time)
        self.queue_time.observe(req.scheduled_time - req.queued_time)
        self.prefill_time.observe(req.first_token_time - req.scheduled_time)
        self.inference_time.observe(req.finish_time - req.scheduled_time)
        self.decode_time.observe(req.finish_time - req.first_token_time)
        self.request_prompt_tokens.observe(req.num_prompt_tokens)
        self.request_generation_tokens.observe(len(req.output_token_ids))
