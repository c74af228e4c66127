"""Endpoint state: immutable snapshots read by the picker, stores that keep them fresh."""

from epp.state.snapshot import EndpointMetrics, EndpointState, Snapshot
from epp.state.store import StateStore

__all__ = ["EndpointMetrics", "EndpointState", "Snapshot", "StateStore"]
