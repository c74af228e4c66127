"""Pickers: choose the endpoint (and ordered fallbacks) from total scores."""

from epp.scheduling.pickers import max_score

__all__ = ["max_score"]
