"""Benchmarks: overhead.py (latency epp adds) and routing.py (routing quality)."""
