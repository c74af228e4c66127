"""Filters: remove endpoints that must not serve a request."""

from epp.scheduling.filters import health, kv_headroom, latency_target, lora, ready, role

__all__ = ["health", "kv_headroom", "latency_target", "lora", "ready", "role"]
