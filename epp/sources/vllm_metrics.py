"""Parse a vLLM ``/metrics`` page into :class:`~epp.state.snapshot.EndpointMetrics`.

The scraper reads every endpoint's page every 50 ms, so this runs twenty times a second per
endpoint. A page is tens of kilobytes, nearly all histogram buckets and process metrics that the
picker never reads. prometheus_client's parser builds an object per sample, milliseconds
for the page of a real vLLM server. Here a single compiled pattern that starts with the
literal ``\\nvllm:`` and lists only the wanted names lets the regex engine's literal search skip
everything else, and labels are parsed only for the two info series that carry data in labels
(a plain Python loop over lines is several times slower).

Rules, following vLLM's exposition:

- A page may carry several label sets per metric (data-parallel engines, ``engine="0"``,
  ``engine="1"``...): counts and counters are summed, KV usage is the maximum (the fullest engine
  is what a new request risks meeting), cache capacity is summed over engines.
- ``vllm:kv_cache_usage_perc`` replaced ``vllm:gpu_cache_usage_perc`` and
  ``vllm:prefix_cache_*`` replaced ``vllm:gpu_prefix_cache_*``; some releases publish both names
  with the same values, so the newer name wins whenever it is present and they are never added.
- ``vllm:lora_requests_info`` carries its data in labels and a timestamp as its value; label sets
  of the past stay on the page, so per engine only the series with the largest value counts.
- ``rank``: only the series of that engine (a data-parallel rank scheduled as an endpoint of
  its own, :mod:`epp.data_parallel`), plus those without an ``engine`` label (process-wide);
  a page without that engine's request-queue series raises :class:`ValueError`.
- Unparsable lines and non-finite values are skipped; a metric that is absent keeps the
  :class:`EndpointMetrics` default. A page without any request-queue series is not a vLLM page
  (an HTML error page, a proxy's answer, an empty body) and raises :class:`ValueError`, so the
  scraper counts it as a failed scrape instead of reporting an idle replica.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from typing import NamedTuple

from epp.state.snapshot import EndpointMetrics

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
_QUERIES = "vllm:prefix_cache_queries_total"
_QUERIES_OLD = "vllm:gpu_prefix_cache_queries_total"
_HITS = "vllm:prefix_cache_hits_total"
_HITS_OLD = "vllm:gpu_prefix_cache_hits_total"
_PREEMPTIONS = "vllm:num_preemptions_total"
_CACHE_CONFIG = "vllm:cache_config_info"
_LORA = "vllm:lora_requests_info"

# Series whose values add up across engines.
_SUMMED = frozenset({_RUNNING, _WAITING, _QUERIES, _QUERIES_OLD, _HITS, _HITS_OLD, _PREEMPTIONS})
_ALL = (*_SUMMED, _KV_USAGE, _KV_USAGE_OLD, _CACHE_CONFIG, _LORA)

# One sample line: name, optional label block, value (an optional timestamp may follow). The
# label block runs to the LAST "}" of the line, so a "}" inside a quoted label value cannot cut
# it short; a sample value never contains "}". Requiring "{" or blanks right after the name keeps
# e.g. "vllm:num_requests_running_x" from matching. Matches start at "\n", so callers prepend one.
_SAMPLE = re.compile(
    r"\n(" + "|".join(re.escape(n) for n in sorted(_ALL)) + r")(?:\{(.*)\})?[ \t]+(\S+)"
)


def finite_samples(pattern: re.Pattern[str], text: str) -> Iterator[tuple[str, str, float]]:
    """(name, label text, value) of each sample ``pattern`` matches in an exposition page;
    samples whose value is not a finite number are skipped."""
    for name, label_text, raw in pattern.findall("\n" + text):
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isfinite(value):
            yield name, label_text, value


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def parse_vllm_metrics(text: str, rank: int | None = None) -> EndpointMetrics:
    """Extract what the picker needs from one ``/metrics`` page, or from ``rank``'s series.

    Raises :class:`ValueError` if the page has neither ``vllm:num_requests_running`` nor
    ``vllm:num_requests_waiting`` (of that engine).
    """
    wanted = None if rank is None else str(rank)
    sums: dict[str, float] = {}
    kv_usage: dict[str, float] = {}
    # Per engine label value: (block_size, num_gpu_blocks) and (timestamp, lora info).
    cache_config: dict[str, tuple[int | None, int | None]] = {}
    lora: dict[str, tuple[float, _LoraInfo]] = {}

    for name, label_text, value in finite_samples(_SAMPLE, text):
        if wanted is not None and _engine(label_text) not in (wanted, ""):
            continue
        if name in _SUMMED:
            sums[name] = sums.get(name, 0.0) + value
        elif name in (_KV_USAGE, _KV_USAGE_OLD):
            kv_usage[name] = max(kv_usage.get(name, value), value)
        elif name == _CACHE_CONFIG:
            engine, block_size, gpu_blocks = _cache_config(label_text)
            cache_config[engine] = (block_size, gpu_blocks)
        else:  # _LORA
            info = _lora_info(label_text)
            if info.engine not in lora or value > lora[info.engine][0]:
                lora[info.engine] = (value, info)

    if _RUNNING not in sums and _WAITING not in sums:
        raise ValueError(
            "not a vLLM metrics page: no vllm:num_requests_running/waiting series"
            + ("" if wanted is None else f' of engine="{wanted}"')
        )

    usage = kv_usage.get(_KV_USAGE, kv_usage.get(_KV_USAGE_OLD, 0.0))
    block_sizes = [b for b, _ in cache_config.values() if b is not None]
    gpu_block_counts = [n for _, n in cache_config.values() if n is not None]
    latest = [info for _, info in lora.values()]

    return EndpointMetrics(
        waiting=max(0, round(sums.get(_WAITING, 0.0))),
        running=max(0, round(sums.get(_RUNNING, 0.0))),
        kv_usage=min(1.0, max(0.0, usage)),
        block_size=max(block_sizes) if block_sizes else None,
        num_gpu_blocks=sum(gpu_block_counts) if gpu_block_counts else None,
        running_loras=frozenset().union(*(info.running for info in latest)),
        waiting_loras=frozenset().union(*(info.waiting for info in latest)),
        max_loras=sum(info.max_loras for info in latest),
        prefix_cache_queries=sums.get(_QUERIES, sums.get(_QUERIES_OLD, 0.0)),
        prefix_cache_hits=sums.get(_HITS, sums.get(_HITS_OLD, 0.0)),
        preemptions=sums.get(_PREEMPTIONS, 0.0),
    )


class _LoraInfo(NamedTuple):
    engine: str
    running: frozenset[str]
    waiting: frozenset[str]
    max_loras: int


# The two info series repeat the same label text on every scrape (cache_config_info's is ~1 KB,
# the dearest part of a page to parse), so their parses are memoized; vLLM itself keeps every
# label set it ever published, so the number of distinct texts is small.
@functools.lru_cache(maxsize=1024)
def _engine(label_text: str) -> str:
    # The rank filter reads every sample's labels; a page repeats the same few label texts.
    return parse_labels(label_text).get("engine", "")


@functools.lru_cache(maxsize=1024)
def _cache_config(label_text: str) -> tuple[str, int | None, int | None]:
    labels = parse_labels(label_text)
    return (
        labels.get("engine", ""),
        _positive_int(labels.get("block_size")),
        _positive_int(labels.get("num_gpu_blocks")),
    )


@functools.lru_cache(maxsize=1024)
def _lora_info(label_text: str) -> _LoraInfo:
    labels = parse_labels(label_text)
    return _LoraInfo(
        engine=labels.get("engine", ""),
        running=_split_list(labels.get("running_lora_adapters", "")),
        waiting=_split_list(labels.get("waiting_lora_adapters", "")),
        max_loras=_positive_int(labels.get("max_lora")) or 0,
    )


def parse_labels(text: str) -> dict[str, str]:
    """``a="x",b="y\\"z"`` -> ``{"a": "x", "b": 'y"z'}``; malformed pairs are skipped."""
    if not text:
        return {}
    return {
        key: _ESCAPE.sub(_unescape, value) if "\\" in value else value
        for key, value in _LABEL.findall(text)
    }


def _unescape(match: re.Match[str]) -> str:
    # The exposition format escapes only backslash, double quote and newline.
    char = match.group(1)
    return "\n" if char == "n" else char


def _positive_int(text: str | None) -> int | None:
    # vLLM writes "None" for unset config fields and "0" blocks before profiling finished.
    try:
        value = int(text) if text is not None else 0
    except ValueError:
        return None
    return value if value > 0 else None


def _split_list(text: str) -> frozenset[str]:
    return frozenset(item.strip() for item in text.split(",") if item.strip())
