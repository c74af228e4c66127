"""Filters: remove endpoints that must not serve a request."""

from epp.scheduling.filters import (
    head_of_line,
    health,
    kv_headroom,
    latency_target,
    lora,
    ready,
    role,
)

__all__ = ["head_of_line", "health", "kv_headroom", "latency_target", "lora", "ready", "role"]
