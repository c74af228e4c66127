"""Filters: remove endpoints that must not serve a request."""

from epp.scheduling.filters import kv_headroom, lora, ready

__all__ = ["kv_headroom", "lora", "ready"]
