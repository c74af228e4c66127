"""parse_sglang_metrics against pages in SGLang's exposition.

The metric names, types and label names below are SGLang's, read from its source at
sgl-project/sglang commit 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538:
python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector: ``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:cache_hit_rate``,
``sglang:num_retracted_requests_total``, the grammar and disaggregation queues;
TokenizerMetricsCollector: ``sglang:prompt_tokens_total``, ``sglang:cached_tokens_total``),
with the scheduler labels set in python/sglang/srt/managers/scheduler_metrics_mixin.py
(``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``dp_rank`` when data parallel;
``moe_ep_rank`` in the collector's version). SGLang serves them through prometheus_client's
multiprocess collector, so gauges carry no ``_created`` twin and values print as floats.
"""

from __future__ import annotations

import pytest

from epp.sources.sglang_metrics import parse_sglang_metrics
from epp.state.snapshot import EndpointMetrics

MODEL = 'model_name="qwen"'


def scheduler_labels(tp: int = 0, dp: int | None = None, engine_type: str = "unified") -> str:
    labels = f'engine_type="{engine_type}",{MODEL},moe_ep_rank="0",pp_rank="0",tp_rank="{tp}"'
    return labels if dp is None else f'dp_rank="{dp}",{labels}'


def gauge(name: str, value: float, labels: str) -> str:
    return f"# HELP {name} .\n# TYPE {name} gauge\n{name}{{{labels}}} {value}\n"


def counter(name: str, value: float, labels: str = MODEL) -> str:
    return f"# HELP {name} .\n# TYPE {name} counter\n{name}{{{labels}}} {value}\n"


def page(
    running: float = 3.0,
    queue: float = 2.0,
    usage: float = 0.25,
    *,
    labels: str | None = None,
    extra: str = "",
) -> str:
    labels = labels if labels is not None else scheduler_labels()
    return (
        gauge("sglang:num_running_reqs", running, labels)
        + gauge("sglang:num_used_tokens", 4096.0, labels)
        + gauge("sglang:token_usage", usage, labels)
        + gauge("sglang:gen_throughput", 812.5, labels)
        + gauge("sglang:num_queue_reqs", queue, labels)
        + gauge("sglang:num_grammar_queue_reqs", 0.0, labels)
        + gauge("sglang:cache_hit_rate", 0.9, labels)
        + gauge("sglang:max_total_num_tokens", 16384.0, labels)
        + counter("sglang:num_retracted_requests_total", 4.0, labels)
        + counter("sglang:prompt_tokens_total", 12000.0)
        + counter("sglang:generation_tokens_total", 3000.0)
        + counter("sglang:cached_tokens_total", 9000.0)
        + "# HELP sglang:time_to_first_token_seconds .\n"
        + "# TYPE sglang:time_to_first_token_seconds histogram\n"
        + f'sglang:time_to_first_token_seconds_bucket{{le="0.1",{MODEL}}} 7.0\n'
        + f"sglang:time_to_first_token_seconds_count{{{MODEL}}} 9.0\n"
        + extra
    )


def test_a_single_scheduler_page_maps_to_endpoint_state() -> None:
    assert parse_sglang_metrics(page()) == EndpointMetrics(
        waiting=2,
        running=3,
        kv_usage=0.25,
        prefix_cache_queries=12000.0,
        prefix_cache_hits=9000.0,
        preemptions=4.0,
    )


def test_cache_geometry_and_lora_stay_unknown() -> None:
    # SGLang publishes neither its page size nor the adapters in flight.
    metrics = parse_sglang_metrics(page())
    assert metrics.block_size is None
    assert metrics.num_gpu_blocks is None
    assert metrics.usable_kv_blocks is None
    assert (metrics.running_loras, metrics.waiting_loras, metrics.max_loras) == (
        frozenset(),
        frozenset(),
        0,
    )


def test_requests_in_the_grammar_and_disaggregation_queues_are_waiting() -> None:
    labels = scheduler_labels(engine_type="decode")
    extra = (
        gauge("sglang:num_decode_prealloc_queue_reqs", 5.0, labels)
        + gauge("sglang:num_decode_transfer_queue_reqs", 1.0, labels)
        + gauge("sglang:num_prefill_inflight_queue_reqs", 7.0, labels)
    )
    # The page lists num_grammar_queue_reqs 0 already; a second series for another rank adds.
    extra += gauge("sglang:num_grammar_queue_reqs", 2.0, scheduler_labels(dp=1))
    metrics = parse_sglang_metrics(page(queue=3.0, labels=labels, extra=extra))
    # In flight to the decoder (inflight queue) is done here, not waiting.
    assert metrics.waiting == 3 + 5 + 1 + 2


def test_data_parallel_ranks_add_up_and_the_fullest_rank_sets_kv_usage() -> None:
    text = page(running=3.0, queue=1.0, usage=0.2, labels=scheduler_labels(dp=0)) + "".join(
        gauge(name, value, scheduler_labels(dp=1))
        for name, value in (
            ("sglang:num_running_reqs", 5.0),
            ("sglang:num_queue_reqs", 4.0),
            ("sglang:token_usage", 0.7),
        )
    )
    metrics = parse_sglang_metrics(text)
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (8, 5, 0.7)


def test_tensor_parallel_ranks_repeat_one_scheduler_and_are_not_added() -> None:
    # --enable-metrics-for-all-schedulers: every TP rank reports the same scheduler state.
    text = page(running=3.0, queue=2.0) + "".join(
        gauge(name, value, scheduler_labels(tp=1))
        for name, value in (("sglang:num_running_reqs", 3.0), ("sglang:num_queue_reqs", 2.0))
    )
    metrics = parse_sglang_metrics(text)
    assert (metrics.running, metrics.waiting) == (3, 2)


def test_labels_in_any_order_and_with_tricky_values() -> None:
    labels = r'tp_rank="0",model_name="a}b\"c",pp_rank="0",dp_rank="0",engine_type="unified"'
    assert parse_sglang_metrics(page(running=6.0, labels=labels)).running == 6


def test_the_vllm_names_are_not_read_on_an_sglang_page() -> None:
    text = page(running=1.0) + 'vllm:num_requests_running{engine="0"} 50.0\n'
    assert parse_sglang_metrics(text).running == 1


def test_only_the_exact_names_are_read() -> None:
    text = page(running=1.0, extra=gauge("sglang:num_running_reqs_offline_batch", 9.0, MODEL))
    assert parse_sglang_metrics(text).running == 1


def test_usage_is_clamped_and_bad_values_skipped() -> None:
    text = page(usage=1.7, extra='sglang:num_queue_reqs{dp_rank="9"} NaN\n')
    metrics = parse_sglang_metrics(text)
    assert metrics.kv_usage == 1.0
    assert metrics.waiting == 2


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html>502 Bad Gateway</html>",
        # A vLLM page is not an SGLang page.
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n',
        # Declared but never written: SGLang before its scheduler's first report.
        "# HELP sglang:num_running_reqs .\n# TYPE sglang:num_running_reqs gauge\n",
    ],
)
def test_a_page_without_scheduler_series_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not an SGLang metrics page"):
        parse_sglang_metrics(text)


def test_a_page_with_only_the_queue_gauge_is_enough() -> None:
    text = gauge("sglang:num_queue_reqs", 4.0, scheduler_labels())
    assert parse_sglang_metrics(text) == EndpointMetrics(waiting=4)
