"""Envoy-facing side: the ext_proc servicer, its per-stream state machine, response builders."""
