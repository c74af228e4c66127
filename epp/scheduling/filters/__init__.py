"""Filters: remove endpoints that must not serve a request."""

from epp.scheduling.filters import ready

__all__ = ["ready"]
