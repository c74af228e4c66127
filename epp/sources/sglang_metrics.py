"""Parse an SGLang server's ``/metrics`` page into :class:`~epp.state.snapshot.EndpointMetrics`.

Names and labels as SGLang's metrics collector defines them (``SchedulerMetricsCollector`` and
``TokenizerMetricsCollector`` in ``python/sglang/srt/metrics/collector.py``, later moved to
``python/sglang/srt/observability/metrics_collector.py`` with the same names; read at
sgl-project/sglang commit 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538). What epp reads:

- ``running``: ``sglang:num_running_reqs``;
- ``waiting``: ``sglang:num_queue_reqs``, plus the requests SGLang holds in its grammar queue
  and, with prefill/decode disaggregation, in its bootstrap, pre-allocation and transfer
  queues (``sglang:num_grammar_queue_reqs``, ``sglang:num_prefill_prealloc_queue_reqs``,
  ``sglang:num_decode_prealloc_queue_reqs``, ``sglang:num_decode_transfer_queue_reqs``): all
  wait for this engine before they run;
- ``kv_usage``: ``sglang:token_usage`` (a fraction of the KV token pool);
- ``prefix_cache_queries`` / ``prefix_cache_hits``: ``sglang:prompt_tokens_total`` /
  ``sglang:cached_tokens_total`` (prompt tokens, and those found cached; counters);
- ``preemptions``: ``sglang:num_retracted_requests_total`` (SGLang calls preemption "retract").

``sglang:cache_hit_rate`` is not read: it is the last prefill batch's ratio (and 0 after a
decode batch), not a rate over time; the two token counters give the same ratio over any
window. SGLang publishes no KV block geometry (its page size is not a metric), so
``block_size`` and ``num_gpu_blocks`` stay unknown and the precise prefix scorer takes the page
size from the KV events; nor does it name the LoRA adapters in flight, so the LoRA fields stay
empty (epp then treats every endpoint as having room for an adapter).

Label sets: the scheduler's gauges carry ``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank``, ``moe_ep_rank`` and, with data parallelism, ``dp_rank``. By default only the
first tensor-parallel rank of each data-parallel rank reports; with
``--enable-metrics-for-all-schedulers`` every rank repeats the same counts. So series are
grouped by ``dp_rank``: within one data-parallel rank the largest value counts (the ranks
describe one scheduler), across ranks counts are summed and KV usage is the maximum, as for
vLLM's engines. The tokenizer's counters carry no rank and are summed.

A page without any ``sglang:num_running_reqs`` or ``sglang:num_queue_reqs`` series raises
:class:`ValueError` (not an SGLang page, or a server that has not reported yet: SGLang writes
its scheduler gauges after its first batch, or after 30 idle seconds).
"""

from __future__ import annotations

import functools
import re

from epp.sources.vllm_metrics import finite_samples, parse_labels
from epp.state.snapshot import EndpointMetrics

_RUNNING = "sglang:num_running_reqs"
_QUEUE = "sglang:num_queue_reqs"
_USAGE = "sglang:token_usage"
_PROMPT = "sglang:prompt_tokens_total"
_CACHED = "sglang:cached_tokens_total"
_RETRACTED = "sglang:num_retracted_requests_total"
# More requests waiting for this engine, in queues other than the main one.
_ALSO_WAITING = (
    "sglang:num_grammar_queue_reqs",
    "sglang:num_prefill_prealloc_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
# Scheduler series: one value per data-parallel rank, repeated by its other ranks.
_PER_RANK = frozenset({_RUNNING, _QUEUE, _USAGE, _RETRACTED, *_ALSO_WAITING})
# Tokenizer series: summed over whatever label sets they have.
_SUMMED = frozenset({_PROMPT, _CACHED})

# Same shape as the vLLM parser's pattern (see epp.sources.vllm_metrics): only the wanted names,
# matched from a line start, the label block up to the line's last "}".
_SAMPLE = re.compile(
    r"\n(" + "|".join(re.escape(n) for n in sorted(_PER_RANK | _SUMMED)) + r")(?:\{(.*)\})?"
    r"[ \t]+(\S+)"
)


def parse_sglang_metrics(text: str, rank: int | None = None) -> EndpointMetrics:
    """Extract what the picker needs from one SGLang ``/metrics`` page, or only from the
    scheduler series of ``dp_rank`` ``rank`` (:mod:`epp.data_parallel`). The tokenizer's
    counters are the whole server's and name no rank: a rank reports no prefix-cache counts.

    Raises :class:`ValueError` if the page has neither ``sglang:num_running_reqs`` nor
    ``sglang:num_queue_reqs`` (of that rank).
    """
    wanted = None if rank is None else str(rank)
    # name -> dp_rank -> the largest value over that rank's series.
    ranked: dict[str, dict[str, float]] = {}
    sums: dict[str, float] = {}
    for name, label_text, value in finite_samples(_SAMPLE, text):
        if name in _SUMMED:
            if wanted is None:
                sums[name] = sums.get(name, 0.0) + value
            continue
        dp_rank = _dp_rank(label_text)
        if wanted is not None and dp_rank != wanted:
            continue
        ranks = ranked.setdefault(name, {})
        ranks[dp_rank] = max(ranks.get(dp_rank, value), value)

    if _RUNNING not in ranked and _QUEUE not in ranked:
        raise ValueError("not an SGLang metrics page: no sglang:num_running_reqs/num_queue_reqs")

    def total(name: str) -> float:
        return sum(ranked.get(name, {}).values())

    waiting = total(_QUEUE) + sum(total(name) for name in _ALSO_WAITING)
    usage = max(ranked.get(_USAGE, {}).values(), default=0.0)
    return EndpointMetrics(
        waiting=max(0, round(waiting)),
        running=max(0, round(total(_RUNNING))),
        kv_usage=min(1.0, max(0.0, usage)),
        prefix_cache_queries=sums.get(_PROMPT, 0.0),
        prefix_cache_hits=sums.get(_CACHED, 0.0),
        preemptions=total(_RETRACTED),
    )


# A server repeats the same few label texts on every scrape (one per rank).
@functools.lru_cache(maxsize=1024)
def _dp_rank(label_text: str) -> str:
    return parse_labels(label_text).get("dp_rank", "")
