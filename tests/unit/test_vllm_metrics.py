"""parse_vllm_metrics against real and hand-written pages, checked by a second tokenizer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.sources.vllm_metrics import parse_vllm_metrics
from epp.state.snapshot import EndpointMetrics

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SAMPLE_V0 = FIXTURES / "metrics_sample_v0.txt"
REAL = FIXTURES / "vllm" / "metrics.txt"
REAL_LORA = FIXTURES / "vllm" / "metrics_lora.txt"


def _fixture(path: Path) -> object:
    return pytest.param(
        path,
        id=path.name,
        marks=pytest.mark.skipif(not path.exists(), reason=f"{path} not captured yet"),
    )


def _reference(text: str) -> EndpointMetrics:
    """The same rules computed from prometheus_client's (slow, independent) tokenizer."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def values(name: str) -> list[float]:
        return [s.value for s in samples if s.name == name and math.isfinite(s.value)]

    def total(new: str, old: str | None = None) -> float:
        found = values(new) or (values(old) if old else [])
        return sum(found)

    kv = values("vllm:kv_cache_usage_perc") or values("vllm:gpu_cache_usage_perc") or [0.0]
    configs = {
        s.labels.get("engine", ""): s.labels for s in samples if s.name == "vllm:cache_config_info"
    }
    configs = {e: c for e, c in configs.items() if c.get("block_size")}
    latest: dict[str, tuple[float, dict[str, str]]] = {}
    for s in samples:
        engine = s.labels.get("engine", "")
        if s.name == "vllm:lora_requests_info" and s.value > latest.get(engine, (-1.0, {}))[0]:
            latest[engine] = (s.value, s.labels)
    lora = [labels for _, labels in latest.values()]
    return EndpointMetrics(
        waiting=round(total("vllm:num_requests_waiting")),
        running=round(total("vllm:num_requests_running")),
        kv_usage=max(kv),
        block_size=max((int(c["block_size"]) for c in configs.values()), default=None),
        num_gpu_blocks=sum(int(c["num_gpu_blocks"]) for c in configs.values()) or None,
        running_loras=frozenset(
            a for labels in lora for a in labels["running_lora_adapters"].split(",") if a
        ),
        waiting_loras=frozenset(
            a for labels in lora for a in labels["waiting_lora_adapters"].split(",") if a
        ),
        max_loras=sum(int(labels["max_lora"]) for labels in lora),
        prefix_cache_queries=total(
            "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"
        ),
        prefix_cache_hits=total("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        preemptions=total("vllm:num_preemptions_total"),
    )


@pytest.mark.parametrize("path", [_fixture(SAMPLE_V0), _fixture(REAL), _fixture(REAL_LORA)])
def test_fixture_pages_agree_with_prometheus_client(path: Path) -> None:
    text = path.read_text()
    assert parse_vllm_metrics(text) == _reference(text)


def test_sample_v0_page_values() -> None:
    # Older naming: gpu_cache_usage_perc and gpu_prefix_cache_*; four lora_requests_info label
    # sets, the newest of which is not the last one on the page.
    metrics = parse_vllm_metrics(SAMPLE_V0.read_text())
    assert metrics == EndpointMetrics(
        waiting=2,
        running=3,
        kv_usage=0.4375,
        block_size=16,
        num_gpu_blocks=27040,
        running_loras=frozenset({"sql-lora", "chat-lora"}),
        waiting_loras=frozenset({"sql-lora"}),
        max_loras=4,
        prefix_cache_queries=184320.0,
        prefix_cache_hits=98304.0,
        preemptions=7.0,
    )


@pytest.mark.skipif(not REAL.exists(), reason="real vLLM capture not present yet")
def test_real_capture_values() -> None:
    # vLLM 0.32 on CPU, --block-size 32, 8 MiB of KV cache, idle after the capture's requests.
    # It also publishes vllm:num_requests_waiting_by_reason, which must not count as waiting.
    metrics = parse_vllm_metrics(REAL.read_text())
    assert metrics == EndpointMetrics(
        block_size=32,
        num_gpu_blocks=128,
        prefix_cache_queries=4638.0,
        prefix_cache_hits=2208.0,
    )


@pytest.mark.skipif(not REAL_LORA.exists(), reason="real vLLM LoRA capture not present yet")
def test_real_lora_capture_takes_newest_series_not_last() -> None:
    # The page lists the current (empty) adapter set first and a stale "tiny-lora" set after it.
    metrics = parse_vllm_metrics(REAL_LORA.read_text())
    assert metrics.max_loras == 2
    assert metrics.running_loras == frozenset()
    assert metrics.waiting_loras == frozenset()


def test_lora_takes_series_with_largest_timestamp() -> None:
    page = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",'
        'waiting_lora_adapters="b"} 1.7e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,c",'
        'waiting_lora_adapters=""} 1.7000000009e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.6999e+09\n'
        'vllm:num_requests_running{model_name="m"} 1.0\n'
    )
    metrics = parse_vllm_metrics(page)
    assert metrics.running_loras == {"a", "c"}
    assert metrics.waiting_loras == frozenset()
    assert metrics.max_loras == 2


def test_data_parallel_engines_are_combined() -> None:
    page = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 3.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 4.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0',
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5.0',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 1.0',
            'vllm:num_preemptions_total{engine="1",model_name="m"} 2.0',
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1.0',
            'vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="120"} 1.0',
            'vllm:lora_requests_info{engine="0",max_lora="2",running_lora_adapters="a",'
            'waiting_lora_adapters=""} 20.0',
            'vllm:lora_requests_info{engine="0",max_lora="2",running_lora_adapters="old",'
            'waiting_lora_adapters=""} 10.0',
            'vllm:lora_requests_info{engine="1",max_lora="2",running_lora_adapters="b",'
            'waiting_lora_adapters="c"} 15.0',
        ]
    )
    metrics = parse_vllm_metrics(page)
    assert (metrics.running, metrics.waiting) == (5, 4)
    assert metrics.kv_usage == 0.75
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (150.0, 15.0)
    assert metrics.preemptions == 3.0
    assert (metrics.block_size, metrics.num_gpu_blocks) == (32, 220)
    assert metrics.running_loras == {"a", "b"}
    assert metrics.waiting_loras == {"c"}
    assert metrics.max_loras == 4


def test_newer_names_win_over_deprecated_ones_and_are_not_added() -> None:
    # vLLM 0.10 published both names side by side.
    page = "\n".join(
        [
            'vllm:num_requests_running{engine="0"} 1.0',
            'vllm:gpu_cache_usage_perc{engine="0"} 0.9',
            'vllm:kv_cache_usage_perc{engine="0"} 0.5',
            'vllm:gpu_prefix_cache_queries_total{engine="0"} 40.0',
            'vllm:prefix_cache_queries_total{engine="0"} 40.0',
            'vllm:gpu_prefix_cache_hits_total{engine="0"} 8.0',
            'vllm:prefix_cache_hits_total{engine="0"} 8.0',
        ]
    )
    metrics = parse_vllm_metrics(page)
    assert metrics.kv_usage == 0.5
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (40.0, 8.0)


def test_missing_metrics_take_defaults() -> None:
    metrics = parse_vllm_metrics('vllm:num_requests_waiting{model_name="m"} 6.0\n')
    assert metrics == EndpointMetrics(waiting=6)


def test_escaped_label_values() -> None:
    page = (
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="we\\"ird,back\\\\slash",'
        'waiting_lora_adapters="bra}ce,new\\nline"} 5.0\n'
        'vllm:num_requests_running{model_name="a \\"quoted\\" } name"} 2.0\n'
    )
    metrics = parse_vllm_metrics(page)
    assert metrics.running_loras == {'we"ird', "back\\slash"}
    assert metrics.waiting_loras == {"bra}ce", "new\nline"}
    assert metrics.running == 2


def test_garbage_and_special_values_are_skipped() -> None:
    page = "\r\n".join(
        [
            "\x00\xff binary junk",
            "vllm:num_requests_running",
            'vllm:num_requests_running{model_name="m" 7.0',
            "vllm:num_requests_running{} not-a-number",
            "vllm:num_requests_running{} NaN",
            "vllm:num_requests_running{} +Inf",
            "vllm:num_requests_running_extra 100.0",
            "# vllm:num_requests_waiting 50.0",
            "vllm:num_requests_running{} 2.0 1700000000000",
            "vllm:num_requests_waiting 1e0",
            'vllm:kv_cache_usage_perc{engine="0"} -Inf',
            'vllm:kv_cache_usage_perc{engine="1"} 1.5',
            'vllm:cache_config_info{block_size="None",num_gpu_blocks="0"} 1.0',
            'vllm:lora_requests_info{max_lora="x",running_lora_adapters=" a , ,b"} NaN',
            'vllm:lora_requests_info{max_lora="x",running_lora_adapters=" a , ,b"} 3.0',
            'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0',
        ]
    )
    metrics = parse_vllm_metrics(page)
    assert (metrics.running, metrics.waiting) == (2, 1)
    assert metrics.kv_usage == 1.0  # clamped: the scorer expects a fraction
    assert (metrics.block_size, metrics.num_gpu_blocks) == (None, None)
    assert metrics.running_loras == {"a", "b"}
    assert metrics.max_loras == 0


@pytest.mark.parametrize(
    "page",
    [
        "",
        "<html><body>502 Bad Gateway</body></html>",
        "# HELP python_gc_objects_collected_total x\npython_gc_objects_collected_total 1.0\n",
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n',
    ],
    ids=["empty", "html", "not-vllm", "no-queue-series"],
)
def test_pages_without_queue_series_are_rejected(page: str) -> None:
    with pytest.raises(ValueError, match="not a vLLM metrics page"):
        parse_vllm_metrics(page)
