"""Deciders: whether a request's prefill runs on another replica (docs/pd.md)."""

from epp.scheduling.deciders import prefix_based

__all__ = ["prefix_based"]
