"""Metric sources: background tasks that observe replicas and write endpoint state to the store."""

from epp.sources.scraper import MetricsScraper
from epp.sources.vllm_metrics import parse_vllm_metrics

__all__ = ["MetricsScraper", "parse_vllm_metrics"]
