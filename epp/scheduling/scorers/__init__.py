"""Scorers: rate each candidate endpoint in [0, 1] for a request."""

from epp.scheduling.scorers import (
    capacity,
    kv_pressure,
    kv_utilization,
    latency,
    load,
    lora,
    no_hit_lru,
    precise_prefix,
    prefix,
    queue,
    session,
    ttft,
)

__all__ = [
    "capacity",
    "kv_pressure",
    "kv_utilization",
    "latency",
    "load",
    "lora",
    "no_hit_lru",
    "precise_prefix",
    "prefix",
    "queue",
    "session",
    "ttft",
]
