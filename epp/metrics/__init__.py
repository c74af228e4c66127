"""Metrics epp computes rather than counts on the request path: pool gauges read from the
store's snapshot at scrape time, scheduler timing, autoscaling signals (docs/metrics.md)."""
