"""Prefill/decode disaggregation beside a decode replica: the ``epp pd-sidecar`` (docs/pd.md)."""
