"""Scorers: rate each candidate endpoint in [0, 1] for a request."""

from epp.scheduling.scorers import kv_utilization, load, queue, ttft

__all__ = ["kv_utilization", "load", "queue", "ttft"]
