"""Filters: remove endpoints that must not serve a request."""

from epp.scheduling.filters import health, kv_headroom, lora, ready

__all__ = ["health", "kv_headroom", "lora", "ready"]
